// l2l_cvt_fp32_to_bf16 -- narrowing conversion of an IEEE-754 binary32
// a[31:0] to bfloat16 y[15:0], round to nearest, ties to even. Fully
// pipelined: one conversion accepted on every clock-enabled cycle, result
// `L2L_CVT_NARROW_LAT (3) ce-cycles later.
//
// Why: the EPS writes the device copy of p' as bfloat16 when the device
// computes in bfloat16; the contract rounds it to nearest even, keeps
// subnormals and keeps NaN a NaN.
//
// How: bfloat16 is the top half of a binary32 (same exponent range), so the
// result is a[31:16] plus the round-to-nearest-even increment
// a[15] & (a[14:0] != 0 | a[16]) added to {exponent, fraction}: a carry out
// of the fraction bumps the exponent, which turns the largest bfloat16
// subnormal into the smallest normal and rounds values at or above
// 0x7F7F8000 up to infinity. Infinities have a zero low half and pass
// unchanged. A NaN keeps its sign and the top of its payload and is made
// quiet (fraction bit 6 set), so truncating a payload can never turn it into
// an infinity.
//   stage 1  increment and NaN decision
//   stage 2  15-bit increment of {exponent, fraction}
//   stage 3  NaN or the rounded value -> y (the stage only matches the
//            latency of l2l_cvt_fp32_to_fp16, which shares the macro)
//
// Interface (fpga/rtl/README.md): (in_valid, a[31:0]) are sampled on a
// rising clk edge with ce = 1 and (out_valid, y[15:0]) appear LAT ce-cycles
// later and hold while ce = 0. rst is synchronous, active high, acts
// whatever ce is, and clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_cvt_fp32_to_bf16 (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [31:0] a,
    output wire        out_valid,
    output wire [15:0] y
);

    localparam DEPTH = 3;   // the stages below

    initial begin
        if (DEPTH != `L2L_CVT_NARROW_LAT) begin
            $error("l2l_cvt_fp32_to_bf16: pipeline depth %0d != L2L_CVT_NARROW_LAT %0d",
                   DEPTH, `L2L_CVT_NARROW_LAT);
            $finish;
        end
    end

    // stage 1: rounding decision
    wire is_nan = (a[30:23] == 8'hFF) && (a[22:0] != 23'd0);
    wire inc    = a[15] & ((a[14:0] != 15'd0) | a[16]);   // never set for inf (low half zero)

    reg        s1_v;
    reg        s1_nan, s1_inc;
    reg [15:0] s1_hi;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_nan <= is_nan;
            s1_inc <= inc;
            s1_hi  <= a[31:16];
        end
    end

    // stage 2: round
    wire [14:0] mag = s1_hi[14:0] + {14'd0, s1_inc};     // <= 0x7F80: never carries into the sign

    reg        s2_v;
    reg        s2_nan;
    reg [15:0] s2_qnan;                                 // a NaN's result: made quiet
    reg        s2_sign;
    reg [14:0] s2_mag;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_nan  <= s1_nan;
            s2_qnan <= {s1_hi[15:7], 1'b1, s1_hi[5:0]};
            s2_sign <= s1_hi[15];
            s2_mag  <= mag;
        end
    end

    // stage 3: pack, NaN
    reg        s3_v;
    reg [15:0] s3_y;

    always @(posedge clk) begin
        if (rst)     s3_v <= 1'b0;
        else if (ce) s3_v <= s2_v;
        if (ce)
            s3_y <= s2_nan ? s2_qnan : {s2_sign, s2_mag};
    end

    assign out_valid = s3_v;
    assign y         = s3_y;

endmodule

`default_nettype wire
