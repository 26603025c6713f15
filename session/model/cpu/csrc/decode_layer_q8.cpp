// The float32 decode layer and step (csrc/decode_layer.h) on int8 and int4 weights with int8-quantized
// activations (the Q8Lines format of csrc/linear_q8.h, RESIDENT_ACTIVATIONS=int8): resident::decode_layer_q8,
// rms_norm_q8, rotary_q8, lora_add_q8 and the DecodeStackQ8 class. Everything but the linears is the
// float32 layer's arithmetic. Built at run time by session/model/cpu/fused_layer.py for AVX512-VNNI or AVX2.

#include "decode_layer.h"
#include "linear_q8.h"

RESIDENT_DECODE_LAYER(Q8Lines, "q8", "DecodeStackQ8")
