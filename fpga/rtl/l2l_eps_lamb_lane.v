// l2l_eps_lamb_lane -- LAMB's per-element arithmetic in the RTL EPS (both passes):
// one element per clock, the contract's operations (docs/eps-numerics.md "LAMB
// update") in order, each one a separately rounded binary32 operation.
//
//     m' = (b1 * m) + (omb1 * g)              v' = (b2 * v) + (omb2 * (g * g))
//     d  = (sqrt(v') * inv_bc2_sqrt) + eps    q  = m' / d      u = q * inv_bc1
//     u2 = u + (wd * p)     (u + -0.0 past n_decay: exact, u2 = u)
//     pp = p * p            uu = u2 * u2
//
// PASS2 = 1 (LAMB's second pass): m and v are already m' and v' and the
// moment update is bypassed (m' = m, v' = v, g unused); the rest is the same
// operations, so u2 is pass 1's bit for bit. pp and uu are still computed.
//
// Static schedule as l2l_eps_lane (AdamW): handshake-free units on one clock
// enable, late operands in l2l_delay lines sized from l2l_fp_latency.vh.
// Everything leaves LAT ce-cycles after the inputs were sampled:
// LAT = 3*MUL + 2*ADD + SQRT + DIV (sqrt, *inv_bc2_sqrt, +eps, /, *inv_bc1,
// +wd*p, u2*u2) plus, in pass 1, the moments' 2*MUL + ADD: 118 with PASS2 = 0
// and 95 with PASS2 = 1 at the current header.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_lamb_lane #(
    parameter PASS2 = 0,            // 0: pass 1 (m', v' from m, v, g); 1: m, v are m', v'
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire [31:0] b1, omb1, b2, omb2, inv_bc2_sqrt, eps, inv_bc1, wd,
    input  wire        in_valid,
    input  wire        decay_en,    // 1: u2 = u + wd*p (index < n_decay); 0: u2 = u
    input  wire [31:0] g, p, m, v,
    output wire        out_valid,
    output wire [31:0] m_out,       // m'
    output wire [31:0] v_out,       // v'
    output wire [31:0] p_out,       // p, aligned with the rest
    output wire [31:0] u2_out,      // u2
    output wire [31:0] pp_out,      // p * p
    output wire [31:0] uu_out       // u2 * u2
);

    localparam LM = `L2L_FP32_MUL_LAT;
    localparam LA = `L2L_FP32_ADD_LAT;
    localparam LS = `L2L_FP32_SQRT_LAT;
    localparam LD = `L2L_FP32_DIV_LAT;

    localparam T_VP  = (PASS2 != 0) ? 0 : 2 * LM + LA;  // v' (and m' earlier)
    localparam T_MP  = (PASS2 != 0) ? 0 : LM + LA;
    localparam T_SQ  = T_VP + LS;       // sqrt(v')
    localparam T_SC  = T_SQ + LM;       // * inv_bc2_sqrt
    localparam T_D   = T_SC + LA;       // d
    localparam T_Q   = T_D + LD;        // m' / d
    localparam T_U   = T_Q + LM;        // u
    localparam T_U2  = T_U + LA;        // u2
    localparam LAT   = T_U2 + LM;       // uu, everything out

    // ---- m', v' -----------------------------------------------------------------
    wire [31:0] mp, vp;
    wire        vp_vld;
    generate
        if (PASS2 != 0) begin : g_p2
            assign mp = m;
            assign vp = v;
            assign vp_vld = in_valid;
            // pass 2 takes m', v' as they are: g and the moment scalars go unused
            /* verilator lint_off UNUSEDSIGNAL */
            wire [31:0] unused_p2 = g ^ b1 ^ omb1 ^ b2 ^ omb2;
            /* verilator lint_on UNUSEDSIGNAL */
        end else begin : g_p1
            wire [31:0] b1m, omb1g, gg, b2v, ogg, b2v_d;
            wire        mul_vld, ogg_vld;
            wire        unused_vld_omb1g, unused_vld_gg, unused_vld_b2v, unused_vld_mp;
            l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_b1m   (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(b1),   .b(m),
                                                           .out_valid(mul_vld),          .y(b1m));
            l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_omb1g (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(omb1), .b(g),
                                                           .out_valid(unused_vld_omb1g), .y(omb1g));
            l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_gg    (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(g),    .b(g),
                                                           .out_valid(unused_vld_gg),    .y(gg));
            l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_b2v   (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(b2),   .b(v),
                                                           .out_valid(unused_vld_b2v),   .y(b2v));
            l2l_fp32_add u_mp (.clk(clk), .rst(rst), .ce(ce), .in_valid(mul_vld), .a(b1m), .b(omb1g), .sub(1'b0),
                               .out_valid(unused_vld_mp), .y(mp));
            l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_ogg (.clk(clk), .rst(rst), .ce(ce), .in_valid(mul_vld), .a(omb2), .b(gg),
                                                         .out_valid(ogg_vld), .y(ogg));
            l2l_delay #(.WIDTH(32), .DEPTH(LM)) d_b2v (.clk(clk), .rst(rst), .ce(ce), .d(b2v), .q(b2v_d));
            l2l_fp32_add u_vp (.clk(clk), .rst(rst), .ce(ce), .in_valid(ogg_vld), .a(b2v_d), .b(ogg), .sub(1'b0),
                               .out_valid(vp_vld), .y(vp));
        end
    endgenerate

    // ---- d = (sqrt(v') * inv_bc2_sqrt) + eps; q = m' / d; u = q * inv_bc1 ------------
    wire [31:0] sq, sc, dd, mp_d, q, u;
    wire        sq_vld, sc_vld, dd_vld, q_vld, u_vld;
    l2l_fp32_sqrt u_sq (.clk(clk), .rst(rst), .ce(ce), .in_valid(vp_vld), .a(vp),
                        .out_valid(sq_vld), .y(sq));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE))  u_sc (.clk(clk), .rst(rst), .ce(ce), .in_valid(sq_vld), .a(sq), .b(inv_bc2_sqrt),
                                                 .out_valid(sc_vld), .y(sc));
    l2l_fp32_add  u_dd (.clk(clk), .rst(rst), .ce(ce), .in_valid(sc_vld), .a(sc), .b(eps), .sub(1'b0),
                        .out_valid(dd_vld), .y(dd));
    l2l_delay #(.WIDTH(32), .DEPTH(T_D - T_MP)) d_mp (.clk(clk), .rst(rst), .ce(ce), .d(mp), .q(mp_d));
    l2l_fp32_div  u_q  (.clk(clk), .rst(rst), .ce(ce), .in_valid(dd_vld), .a(mp_d), .b(dd),
                        .out_valid(q_vld), .y(q));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE))  u_u  (.clk(clk), .rst(rst), .ce(ce), .in_valid(q_vld), .a(q), .b(inv_bc1),
                                                 .out_valid(u_vld), .y(u));

    // ---- u2 = u + (wd * p), or u + -0.0 past n_decay ------------------------------------
    // wd * p is formed from the sampled p; the choice travels with the element.
    wire [31:0] wdp, wdp_d, u2;
    wire        unused_vld_wdp, u2_vld;
    wire        dec_d;
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_wdp (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(wd), .b(p),
                                                 .out_valid(unused_vld_wdp), .y(wdp));
    l2l_delay #(.WIDTH(32), .DEPTH(T_U - LM)) d_wdp (.clk(clk), .rst(rst), .ce(ce), .d(wdp), .q(wdp_d));
    l2l_delay #(.WIDTH(1),  .DEPTH(T_U))      d_dec (.clk(clk), .rst(rst), .ce(ce), .d(decay_en), .q(dec_d));
    l2l_fp32_add u_u2 (.clk(clk), .rst(rst), .ce(ce), .in_valid(u_vld), .a(u),
                       .b(dec_d ? wdp_d : 32'h80000000), .sub(1'b0),
                       .out_valid(u2_vld), .y(u2));

    // ---- uu = u2 * u2, pp = p * p ----------------------------------------------------------
    wire [31:0] pp, pp_d;
    wire        unused_vld_pp;
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_uu (.clk(clk), .rst(rst), .ce(ce), .in_valid(u2_vld), .a(u2), .b(u2),
                                                .out_valid(out_valid), .y(uu_out));
    l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_pp (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid), .a(p), .b(p),
                                                .out_valid(unused_vld_pp), .y(pp));
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - LM)) d_pp (.clk(clk), .rst(rst), .ce(ce), .d(pp), .q(pp_d));
    assign pp_out = pp_d;

    // ---- the rest, aligned at LAT ----------------------------------------------------------
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_D))  d_mo (.clk(clk), .rst(rst), .ce(ce), .d(mp_d), .q(m_out));
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_VP)) d_vo (.clk(clk), .rst(rst), .ce(ce), .d(vp),   .q(v_out));
    l2l_delay #(.WIDTH(32), .DEPTH(LAT))        d_po (.clk(clk), .rst(rst), .ce(ce), .d(p),    .q(p_out));
    l2l_delay #(.WIDTH(32), .DEPTH(LAT - T_U2)) d_uo (.clk(clk), .rst(rst), .ce(ce), .d(u2),   .q(u2_out));

endmodule

`default_nettype wire
