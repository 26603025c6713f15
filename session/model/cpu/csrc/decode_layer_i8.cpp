// The float32 decode layer and step (csrc/decode_layer.h) on int8 weight-only linears (the Int8Lines
// format of csrc/linear_tiles.h): resident::decode_layer_i8, rms_norm_i8, rotary_i8, lora_add_i8 and
// the DecodeStackI8 class. Everything but the linears is the float32 layer's arithmetic. Built at run
// time by session/model/cpu/fused_layer.py for AVX-512 or AVX2.

#include "decode_layer.h"

RESIDENT_DECODE_LAYER(Int8Lines, "i8", "DecodeStackI8")
