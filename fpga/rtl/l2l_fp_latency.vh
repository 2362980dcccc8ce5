// l2l_fp_latency.vh -- pipeline latency, in clock-enabled cycles, of every
// floating-point unit in fpga/rtl/. A unit samples (in_valid, a, b) on a
// rising edge with ce=1 and presents (out_valid, y) exactly L2L_*_LAT
// ce-cycles later. The AdamW datapath and the reducer delay their bypass
// operands by these numbers, so a unit that changes its pipeline depth
// changes its line here and nothing else.
`ifndef L2L_FP_LATENCY_VH
`define L2L_FP_LATENCY_VH

// add/sub, multiply, conversions (owner: l2l_fp32_add.v, l2l_fp32_mul.v, l2l_cvt_*.v)
`define L2L_FP32_ADD_LAT 7
`define L2L_FP32_MUL_LAT 8
`define L2L_CVT_WIDEN_LAT 1
`define L2L_CVT_NARROW_LAT 3

// divide, square root (owner: l2l_fp32_div.v, l2l_fp32_sqrt.v)
`define L2L_FP32_DIV_LAT 29
`define L2L_FP32_SQRT_LAT 28

`endif
