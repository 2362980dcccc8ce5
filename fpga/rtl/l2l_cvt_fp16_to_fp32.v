// l2l_cvt_fp16_to_fp32 -- widening conversion of an IEEE-754 binary16 a[15:0]
// to binary32 y[31:0]; exact. Fully pipelined: one conversion accepted on
// every clock-enabled cycle, result `L2L_CVT_WIDEN_LAT (1) ce-cycles later.
//
// Why: the EPS reduces gradient contributions that arrive as binary16; the
// contract widens each to binary32 exactly before the first addition.
//
// How: a normal binary16 rebiases its exponent (+112) and appends 13 zero
// fraction bits. A binary16 subnormal f * 2^-24 (f = 1..1023) is a normal
// binary32: with its leading one at bit 9 - lz, the exponent is 112 - lz and
// the fraction is f shifted left by lz + 1 (the leading one becomes hidden).
// Zeros keep their sign; infinities map to infinities; a NaN stays a NaN with
// its sign and payload and is made quiet (fraction bit 22 set).
//
// Interface (fpga/rtl/README.md): (in_valid, a) are sampled on a rising clk
// edge with ce = 1 and (out_valid, y) appear LAT ce-cycles later and hold
// while ce = 0. rst is synchronous, active high, acts whatever ce is, and
// clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_cvt_fp16_to_fp32 (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [15:0] a,
    output wire        out_valid,
    output wire [31:0] y
);

    localparam DEPTH = 1;   // one output register

    initial begin
        if (DEPTH != `L2L_CVT_WIDEN_LAT) begin
            $error("l2l_cvt_fp16_to_fp32: pipeline depth %0d != L2L_CVT_WIDEN_LAT %0d",
                   DEPTH, `L2L_CVT_WIDEN_LAT);
            $finish;
        end
    end

    // leading zeros of a 10-bit fraction (10 when it is zero)
    function [3:0] lzc10;
        input [9:0] x;
        integer i;
        begin
            lzc10 = 4'd10;
            for (i = 0; i < 10; i = i + 1)
                if (x[i]) lzc10 = 4'd9 - i[3:0];
        end
    endfunction

    wire        s   = a[15];
    wire [4:0]  e   = a[14:10];
    wire [9:0]  f   = a[9:0];
    wire [3:0]  lz  = lzc10(f);
    wire [9:0]  fsh = f << (lz + 4'd1);                 // the leading one shifts out at the top

    reg  [31:0] r;
    always @(*) begin
        if (e == 5'h1F)
            r = {s, 8'hFF, (f != 10'd0), f[8:0], 13'd0};        // inf, or quiet NaN with payload
        else if (e != 5'd0)
            r = {s, {3'd0, e} + 8'd112, f, 13'd0};              // normal
        else if (f != 10'd0)
            r = {s, 8'd112 - {4'd0, lz}, fsh[9:0], 13'd0};      // subnormal -> normal
        else
            r = {s, 31'd0};                                     // signed zero
    end

    reg        s1_v;
    reg [31:0] s1_y;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce)
            s1_y <= r;
    end

    assign out_valid = s1_v;
    assign y         = s1_y;

endmodule

`default_nettype wire
