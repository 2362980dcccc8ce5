// l2l_eps_lane -- one lane of the AdamW datapath: one element per clock, the
// EPS contract's operations in the contract's order, each one a separately
// rounded binary32 operation through one FP unit (no fusion, no reassociation).
//
//     p1 = p * decay        (p * 1.0 when decay_en = 0: past the entry's n_decay)
//     m' = (b1 * m) + (omb1 * g)
//     v' = (b2 * v) + (omb2 * (g * g))
//     d  = (sqrt(v') * inv_bc2_sqrt) + eps
//     p' = p1 + (neg_step * (m' / d))
//     c  = p' rounded to the device-copy dtype (CDTYPE: 0 fp32 identity, 1 bf16, 2 fp16)
//
// Why this shape: the units are handshake-free pipelines of fixed latency
// (l2l_fp_latency.vh) that all advance on one clock enable, so the lane is a
// static schedule. The critical path is
//     g*g -> omb2*(.) -> + b2*v -> sqrt -> * inv_bc2_sqrt -> + eps -> m'/d -> neg_step*(.) -> p1 + (.)
// and every operand that joins it later (b2*v, m', p1) waits in an l2l_delay
// sized from the L2L_*_LAT macros. Outputs p', m', v' and the copy leave
// together, LAT ce-cycles after the inputs were sampled (LAT below; 110 + the
// narrowing latency with the current latency header).
//
// The step scalars are constant during a run and go straight to the units.
// decay_en travels with the element (sampled with p): the parameter groups'
// boundary falls anywhere, so each element picks its own decay operand. The
// contract's "past n_decay p1 = p" is p * 1.0 here: exact for every p but a
// NaN (the multiplier's canonical NaN; the contract leaves NaN payloads open),
// subnormals and signed zeros included. A mux on the multiplier's operand
// costs one LUT level in its first stage and no latency; a bypass of the
// multiplier would need its own LM-deep delay line of p.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_lane #(
    parameter CDTYPE = 0,           // device copy dtype: 0 fp32, 1 bf16, 2 fp16
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire        clk,
    input  wire        rst,         // synchronous; clears the valid chains
    input  wire        ce,          // the whole lane advances when 1
    input  wire [31:0] decay, b1, omb1, b2, omb2, inv_bc2_sqrt, eps, neg_step,
    input  wire        in_valid,
    input  wire        decay_en,    // 1: p1 = p * decay (index < n_decay); 0: p1 = p * 1.0
    input  wire [31:0] g, p, m, v,
    output wire        out_valid,
    output wire [31:0] p_out,       // p'
    output wire [31:0] m_out,       // m'
    output wire [31:0] v_out,       // v'
    output wire [((CDTYPE == 0) ? 32 : 16)-1:0] c_out    // device copy of p'
);

    localparam LM = `L2L_FP32_MUL_LAT;
    localparam LA = `L2L_FP32_ADD_LAT;
    localparam LS = `L2L_FP32_SQRT_LAT;
    localparam LD = `L2L_FP32_DIV_LAT;
    localparam LN = (CDTYPE == 0) ? 0 : `L2L_CVT_NARROW_LAT;

    // ce-cycle (after the inputs are sampled) at which each value is presented
    localparam T_MUL1 = LM;             // p1, b1*m, omb1*g, g*g, b2*v
    localparam T_MP   = T_MUL1 + LA;    // m'
    localparam T_OGG  = T_MUL1 + LM;    // omb2*(g*g)
    localparam T_VP   = T_OGG + LA;     // v'
    localparam T_SQ   = T_VP + LS;      // sqrt(v')
    localparam T_SC   = T_SQ + LM;      // sqrt(v') * inv_bc2_sqrt
    localparam T_D    = T_SC + LA;      // d
    localparam T_Q    = T_D + LD;       // m' / d
    localparam T_NS   = T_Q + LM;       // neg_step * (m'/d)
    localparam T_PP   = T_NS + LA;      // p'
    localparam LAT    = T_PP + LN;      // everything out

    initial begin
        if (CDTYPE < 0 || CDTYPE > 2) begin
            $error("l2l_eps_lane: illegal CDTYPE=%0d (0 fp32, 1 bf16, 2 fp16)", CDTYPE);
            $finish;
        end
    end

    // ---- first rank of products, all from the inputs ----------------------
    wire        p1_vld;
    wire [31:0] p1, b1m, omb1g, gg, b2v;
    wire        unused_vld_b1m, unused_vld_omb1g, unused_vld_gg, unused_vld_b2v;

    wire [31:0] p1_b = decay_en ? decay : 32'h3F800000;    // decay or 1.0
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_p1    (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(p),    .b(p1_b),
                                                   .out_valid(p1_vld),           .y(p1));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_b1m   (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(b1),   .b(m),
                                                   .out_valid(unused_vld_b1m),   .y(b1m));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_omb1g (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(omb1), .b(g),
                                                   .out_valid(unused_vld_omb1g), .y(omb1g));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_gg    (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(g),    .b(g),
                                                   .out_valid(unused_vld_gg),    .y(gg));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_b2v   (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(b2),   .b(v),
                                                   .out_valid(unused_vld_b2v),   .y(b2v));

    // ---- m' = (b1*m) + (omb1*g) ---------------------------------------------
    wire [31:0] mp;
    wire        unused_vld_mp;
    l2l_fp32_add u_mp (.clk(clk), .rst(rst), .ce(ce), .in_valid(p1_vld), .a(b1m), .b(omb1g), .sub(1'b0),
                       .out_valid(unused_vld_mp), .y(mp));

    // ---- v' = (b2*v) + (omb2*(g*g)) -------------------------------------------
    wire [31:0] ogg, b2v_d, vp;
    wire        ogg_vld, vp_vld;
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_ogg (.clk(clk), .rst(rst), .ce(ce), .in_valid(p1_vld), .a(omb2), .b(gg),
                                                 .out_valid(ogg_vld), .y(ogg));
    l2l_delay #(.WIDTH(32), .DEPTH(T_OGG - T_MUL1)) d_b2v (.clk(clk), .rst(rst), .ce(ce), .d(b2v), .q(b2v_d));
    l2l_fp32_add u_vp (.clk(clk), .rst(rst), .ce(ce), .in_valid(ogg_vld), .a(b2v_d), .b(ogg), .sub(1'b0),
                       .out_valid(vp_vld), .y(vp));

    // ---- d = (sqrt(v') * inv_bc2_sqrt) + eps ------------------------------------
    wire [31:0] sq, sc, dd;
    wire        sq_vld, sc_vld, dd_vld;
    l2l_fp32_sqrt u_sq (.clk(clk), .rst(rst), .ce(ce), .in_valid(vp_vld), .a(vp),
                        .out_valid(sq_vld), .y(sq));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_sc  (.clk(clk), .rst(rst), .ce(ce), .in_valid(sq_vld), .a(sq), .b(inv_bc2_sqrt),
                                                 .out_valid(sc_vld), .y(sc));
    l2l_fp32_add u_dd  (.clk(clk), .rst(rst), .ce(ce), .in_valid(sc_vld), .a(sc), .b(eps), .sub(1'b0),
                        .out_valid(dd_vld), .y(dd));

    // ---- p' = p1 + (neg_step * (m' / d)) ----------------------------------------
    wire [31:0] mp_d, q, ns, p1_d, pp;
    wire        q_vld, ns_vld, pp_vld;
    l2l_delay #(.WIDTH(32), .DEPTH(T_D - T_MP)) d_mp (.clk(clk), .rst(rst), .ce(ce), .d(mp), .q(mp_d));
    l2l_fp32_div u_q  (.clk(clk), .rst(rst), .ce(ce), .in_valid(dd_vld), .a(mp_d), .b(dd),
                       .out_valid(q_vld), .y(q));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_ns (.clk(clk), .rst(rst), .ce(ce), .in_valid(q_vld), .a(neg_step), .b(q),
                                                .out_valid(ns_vld), .y(ns));
    l2l_delay #(.WIDTH(32), .DEPTH(T_NS - T_MUL1)) d_p1 (.clk(clk), .rst(rst), .ce(ce), .d(p1), .q(p1_d));
    l2l_fp32_add u_pp (.clk(clk), .rst(rst), .ce(ce), .in_valid(ns_vld), .a(p1_d), .b(ns), .sub(1'b0),
                       .out_valid(pp_vld), .y(pp));

    // ---- outputs, aligned at LAT ------------------------------------------------
    // m' continues from the divider's tap, v' from the adder; p' waits for the copy.
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_D))  d_mo (.clk(clk), .rst(rst), .ce(ce), .d(mp_d), .q(m_out));
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_VP)) d_vo (.clk(clk), .rst(rst), .ce(ce), .d(vp),   .q(v_out));
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_PP)) d_po (.clk(clk), .rst(rst), .ce(ce), .d(pp),   .q(p_out));

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
