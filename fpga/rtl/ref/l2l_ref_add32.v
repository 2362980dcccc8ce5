// l2l_ref_add32 -- timing reference: a plain 32-bit adder between two ranks
// of flip-flops, y = a + b one clock after (a, b) are sampled (two after they
// reach the ports: the inputs are registered here as well).
//
// Why: fpga/rtl/timing_ecp5.py reports every FP unit's Fmax as a ratio to
// what the same part, tools and seed give for one carry chain of 32 bits, so
// the figures carry over to another FPGA family as "so many adder delays".
//
// How: registered inputs, one 32-bit addition, registered output; nothing
// else, so the path is clk-to-q, the carry chain and setup.
`default_nettype none

module l2l_ref_add32 (
    input  wire        clk,
    input  wire [31:0] a,
    input  wire [31:0] b,
    output wire [31:0] y
);

    reg [31:0] ra, rb, ry;

    always @(posedge clk) begin
        ra <= a;
        rb <= b;
        ry <= ra + rb;
    end

    assign y = ry;

endmodule

`default_nettype wire
