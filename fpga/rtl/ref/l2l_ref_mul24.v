// l2l_ref_mul24 -- timing reference: an unsigned 24 x 24 -> 48-bit multiplier
// between two ranks of flip-flops, y = a * b one clock after (a, b) are
// sampled (the inputs are registered here as well).
//
// Why: fpga/rtl/timing_ecp5.py reports every FP unit's Fmax as a ratio to
// the reference adder and to this multiplier: a binary32 significand product
// (24 x 24 bits) in one clock, as the synthesis tool maps it onto the part's
// DSP blocks (on ECP5: four MULT18X18D and the adders that sum them), is the
// single-cycle multiply the FP multiplier competes with.
//
// How: registered inputs, one `*`, registered output; the tool chooses the
// DSP split and the partial-product sum.
`default_nettype none

module l2l_ref_mul24 (
    input  wire        clk,
    input  wire [23:0] a,
    input  wire [23:0] b,
    output wire [47:0] y
);

    reg [23:0] ra, rb;
    reg [47:0] ry;

    always @(posedge clk) begin
        ra <= a;
        rb <= b;
        ry <= ra * rb;
    end

    assign y = ry;

endmodule

`default_nettype wire
