// The float32 decode layer and step (csrc/decode_layer.h) on int4 weight-only linears (the Int4Lines
// format of csrc/linear_tiles.h): resident::decode_layer_i4, rms_norm_i4, rotary_i4, lora_add_i4 and
// the DecodeStackI4 class. Everything but the linears is the float32 layer's arithmetic. Built at run
// time by session/model/cpu/fused_layer.py for AVX-512 or AVX2.

#include "decode_layer.h"

RESIDENT_DECODE_LAYER(Int4Lines, "i4", "DecodeStackI4")
