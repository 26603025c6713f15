// The float32 decode layer and step (csrc/decode_layer.h): resident::decode_layer_f32, rms_norm_f32,
// rotary_f32 and the DecodeStackF32 class. Built at run time by session/model/cpu/fused_layer.py with -mavx512f
// only: a CPU without bfloat16 dot products runs it.

#include "decode_layer.h"

RESIDENT_DECODE_LAYER(F32Lines, "f32", "DecodeStackF32")
