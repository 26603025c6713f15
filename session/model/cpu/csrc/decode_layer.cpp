// The bfloat16 decode layer and step (csrc/decode_layer.h): resident::decode_layer_bf16,
// rms_norm_bf16, rotary_bf16 and the DecodeStack class. Built at run time by session/model/cpu/fused_layer.py
// with -mavx512bf16 (the linear tiles' VDPBF16PS).

#include "decode_layer.h"

RESIDENT_DECODE_LAYER(Bf16Pairs, "bf16", "DecodeStack")
