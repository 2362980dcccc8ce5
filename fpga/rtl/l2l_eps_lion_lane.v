// l2l_eps_lion_lane -- one lane of the Lion datapath: one element per clock,
// the EPS contract's Lion operations (docs/eps-numerics.md, "Lion update") in
// order, each product and sum a separately rounded binary32 operation through
// one FP unit (no fusion, no reassociation).
//
//     p1 = p * decay        (p * 1.0 when decay_en = 0: past the entry's n_decay)
//     c  = (b1 * m) + (omb1 * g)
//     p' = p1 + neg_lr  if c > 0;  p1 + (-neg_lr)  if c < 0;  p1 + (-0.0)  if c is +0 or -0
//     m' = (b2 * m) + (omb2 * g)           (from the old m, like c)
//     c_out = p' rounded to the device-copy dtype (CDTYPE: 0 fp32 identity, 1 bf16, 2 fp16)
//
// Why the step is one adder: the golden model adds sign(c) * neg_lr, which is
// exactly +neg_lr or -neg_lr (a sign flip), and leaves p1 alone where c is a
// zero. So the adder's second operand is neg_lr with its sign bit flipped when
// c is negative, and -0.0 when c is a zero: p1 + (-0.0) is p1 bit for bit for
// every p1 but a NaN (+0 + -0 = +0, -0 + -0 = -0; the contract leaves a NaN's
// payload open), so no bypass of the adder and no second delay line of p1 is
// needed. A NaN c (only from a non-finite g, which the kernel never updates
// with) gives a NaN operand and so a NaN p', as the golden model's
// sign(NaN) = NaN does; an infinite c is a sign like any other.
//
// Why the operand is registered: deciding it from c (a 31-bit zero test, a
// NaN test and a 3:1 mux) in front of the adder's first stage, which already
// holds a 31-bit magnitude compare, would lengthen that stage; one register
// (T_ST below) costs a clock of latency and 33 flip-flops a lane.
//
// Shape: as l2l_eps_lane (the AdamW lane), a static schedule of
// handshake-free units that advance on one clock enable; bypass operands wait
// in l2l_delay lines sized from the L2L_*_LAT macros. The critical path is
//     b1*m -> + omb1*g -> step operand -> p1 + (.)
// and p1 and m' wait beside it. Outputs p', m' and the copy leave together,
// LAT ce-cycles after the inputs were sampled: LM + 2*LA + 1 (+ the
// narrowing latency), 23 / 26 with the current latency header.
//
// The step scalars are constant during a run and go straight to the units.
// decay_en travels with the element (sampled with p), as in the AdamW lane:
// past n_decay p1 is p * 1.0, exact for every p but a NaN.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_lion_lane #(
    parameter CDTYPE = 0,           // device copy dtype: 0 fp32, 1 bf16, 2 fp16
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire        clk,
    input  wire        rst,         // synchronous; clears the valid chains
    input  wire        ce,          // the whole lane advances when 1
    input  wire [31:0] decay, b1, omb1, b2, omb2, neg_lr,
    input  wire        in_valid,
    input  wire        decay_en,    // 1: p1 = p * decay (index < n_decay); 0: p1 = p * 1.0
    input  wire [31:0] g, p, m,
    output wire        out_valid,
    output wire [31:0] p_out,       // p'
    output wire [31:0] m_out,       // m'
    output wire [((CDTYPE == 0) ? 32 : 16)-1:0] c_out    // device copy of p'
);

    localparam LM = `L2L_FP32_MUL_LAT;
    localparam LA = `L2L_FP32_ADD_LAT;
    localparam LN = (CDTYPE == 0) ? 0 : `L2L_CVT_NARROW_LAT;

    // ce-cycle (after the inputs are sampled) at which each value is presented
    localparam T_MUL1 = LM;             // p1, b1*m, omb1*g, b2*m, omb2*g
    localparam T_C    = T_MUL1 + LA;    // c, m'
    localparam T_ST   = T_C + 1;        // the step operand (registered)
    localparam T_PP   = T_ST + LA;      // p'
    localparam LAT    = T_PP + LN;      // everything out

    initial begin
        if (CDTYPE < 0 || CDTYPE > 2) begin
            $error("l2l_eps_lion_lane: illegal CDTYPE=%0d (0 fp32, 1 bf16, 2 fp16)", CDTYPE);
            $finish;
        end
    end

    // ---- first rank of products, all from the inputs ----------------------
    wire        p1_vld;
    wire [31:0] p1, b1m, omb1g, b2m, omb2g;
    wire        unused_vld_b1m, unused_vld_omb1g, unused_vld_b2m, unused_vld_omb2g;

    wire [31:0] p1_b = decay_en ? decay : 32'h3F800000;    // decay or 1.0
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_p1    (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(p),    .b(p1_b),
                                                   .out_valid(p1_vld),           .y(p1));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_b1m   (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(b1),   .b(m),
                                                   .out_valid(unused_vld_b1m),   .y(b1m));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_omb1g (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(omb1), .b(g),
                                                   .out_valid(unused_vld_omb1g), .y(omb1g));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_b2m   (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(b2),   .b(m),
                                                   .out_valid(unused_vld_b2m),   .y(b2m));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_omb2g (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(omb2), .b(g),
                                                   .out_valid(unused_vld_omb2g), .y(omb2g));

    // ---- c = (b1*m) + (omb1*g);  m' = (b2*m) + (omb2*g) -------------------------
    wire [31:0] c, mp;
    wire        c_vld, unused_vld_mp;
    l2l_fp32_add u_cs (.clk(clk), .rst(rst), .ce(ce), .in_valid(p1_vld), .a(b1m), .b(omb1g), .sub(1'b0),
                       .out_valid(c_vld), .y(c));
    l2l_fp32_add u_mp (.clk(clk), .rst(rst), .ce(ce), .in_valid(p1_vld), .a(b2m), .b(omb2g), .sub(1'b0),
                       .out_valid(unused_vld_mp), .y(mp));

    // ---- the step operand: +-neg_lr by the sign of c, -0.0 for a zero c, NaN for a NaN c ----
    wire        c_zero = (c[30:0] == 31'd0);
    wire        c_nan  = (c[30:23] == 8'hFF) && (c[22:0] != 23'd0);
    wire [31:0] st_d   = c_nan  ? 32'h7FC00000 :
                         c_zero ? 32'h80000000 :
                                  {neg_lr[31] ^ c[31], neg_lr[30:0]};
    wire [31:0] st;
    wire        st_vld;
    l2l_delay #(.WIDTH(32), .DEPTH(T_ST - T_C)) d_st  (.clk(clk), .rst(rst), .ce(ce), .d(st_d), .q(st));
    l2l_delay #(.WIDTH(1), .DEPTH(T_ST - T_C), .RESET(1)) d_stv (.clk(clk), .rst(rst), .ce(ce),
                                                               .d(c_vld), .q(st_vld));

    // ---- p' = p1 + step ------------------------------------------------------------
    wire [31:0] p1_d, pp;
    wire        pp_vld;
    l2l_delay #(.WIDTH(32), .DEPTH(T_ST - T_MUL1)) d_p1 (.clk(clk), .rst(rst), .ce(ce), .d(p1), .q(p1_d));
    l2l_fp32_add u_pp (.clk(clk), .rst(rst), .ce(ce), .in_valid(st_vld), .a(p1_d), .b(st), .sub(1'b0),
                       .out_valid(pp_vld), .y(pp));

    // ---- outputs, aligned at LAT ------------------------------------------------------
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_C))  d_mo (.clk(clk), .rst(rst), .ce(ce), .d(mp), .q(m_out));
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_PP)) d_po (.clk(clk), .rst(rst), .ce(ce), .d(pp), .q(p_out));

    generate
        if (CDTYPE == 0) begin : g_c32
            assign c_out     = pp;
            assign out_valid = pp_vld;
        end else if (CDTYPE == 1) begin : g_cbf16
            l2l_cvt_fp32_to_bf16 u_c (.clk(clk), .rst(rst), .ce(ce), .in_valid(pp_vld), .a(pp),
                                      .out_valid(out_valid), .y(c_out));
        end else begin : g_cf16
            l2l_cvt_fp32_to_fp16 u_c (.clk(clk), .rst(rst), .ce(ce), .in_valid(pp_vld), .a(pp),
                                      .out_valid(out_valid), .y(c_out));
        end
    endgenerate

endmodule

`default_nettype wire
