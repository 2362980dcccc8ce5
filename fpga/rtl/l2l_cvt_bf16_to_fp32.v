// l2l_cvt_bf16_to_fp32 -- widening conversion of a bfloat16 a[15:0] to
// IEEE-754 binary32 y[31:0]; exact. Fully pipelined: one conversion accepted
// on every clock-enabled cycle, result `L2L_CVT_WIDEN_LAT (1) ce-cycles later.
//
// Why: the EPS reduces gradient contributions that arrive as bfloat16; the
// contract widens each to binary32 exactly before the first addition.
//
// How: bfloat16 is the top half of a binary32 (same sign, exponent and
// exponent bias, 7 fraction bits), so the value is {a, 16'h0000}; zeros,
// subnormals and infinities need nothing more. A NaN stays a NaN with its
// sign and payload and is made quiet (fraction bit 22 set), as IEEE-754
// prescribes for a converted signalling NaN.
//
// Interface (fpga/rtl/README.md): (in_valid, a) are sampled on a rising clk
// edge with ce = 1 and (out_valid, y) appear LAT ce-cycles later and hold
// while ce = 0. rst is synchronous, active high, acts whatever ce is, and
// clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_cvt_bf16_to_fp32 (
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
            $error("l2l_cvt_bf16_to_fp32: pipeline depth %0d != L2L_CVT_WIDEN_LAT %0d",
                   DEPTH, `L2L_CVT_WIDEN_LAT);
            $finish;
        end
    end

    wire is_nan = (a[14:7] == 8'hFF) && (a[6:0] != 7'd0);

    reg        s1_v;
    reg [31:0] s1_y;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce)
            s1_y <= {a[15:7], a[6] | is_nan, a[5:0], 16'h0000};
    end

    assign out_valid = s1_v;
    assign y         = s1_y;

endmodule

`default_nettype wire
