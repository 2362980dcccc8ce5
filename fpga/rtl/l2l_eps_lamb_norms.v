// l2l_eps_lamb_norms -- LAMB's first pass in the RTL EPS (docs/eps-numerics.md
// "LAMB update"): one element per clock through l2l_eps_lamb_lane (m', v',
// u2, p*p, u2*u2), then the two segment sums, each in an l2l_eps_lamb_acc
// (16 interleaved binary32 accumulators on one pipelined adder).
//
// Why one element per clock: the contract's sums are 16 accumulators per
// segment, each taking every 16th element; with one adder per sum and its
// latency <= 16 that is exactly one element per clock. (Wider beats would
// need 16 adders per sum with no more parallelism in the contract's order.)
//
// Input: one element per transfer -- the reduced gradient g and the state
// p, m, v; s_axis_decay (its index is below n_decay), s_axis_first /
// s_axis_last (it is its segment's first / last element; a segment of one
// element has both). Output stream: m', v' of every element (p is not
// written in pass 1), m_axis_tlast = that element's s_axis_last. Sums
// stream: one transfer per segment, in segment order, lane j of the sum of
// p*p in m_sums_pp[32j +: 32] and of u2*u2 in m_sums_uu[32j +: 32].
//
// Flow control: as l2l_eps_adamw -- handshake-free units on one clock enable,
// l2l_pipe_skid at the element exit. ce = (skid register empty) AND NOT
// m_sums_valid, both flip-flops: the pipeline freezes while a segment's sums
// wait to be taken (one lost clock per segment when m_sums_ready is held high).
// s_axis_tready = ce never depends combinationally on either ready.
//
// Latency: the elements leave LAT = 5*MUL + 3*ADD + SQRT + DIV
// ce-cycles after they enter (118 at the current l2l_fp_latency.vh, the
// LATENCY output); a segment's sums ADD + 1 (8) ce-cycles after its last element.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_lamb_norms #(
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire          clk, rst,
    input  wire [31:0]   b1, omb1, b2, omb2, inv_bc2_sqrt, eps, inv_bc1, wd,  // held during a run
    input  wire [31:0]   s_axis_g, s_axis_p, s_axis_m, s_axis_v,
    input  wire          s_axis_decay,
    input  wire          s_axis_first,
    input  wire          s_axis_last,
    input  wire          s_axis_tvalid,
    output wire          s_axis_tready,
    output wire [31:0]   m_axis_m, m_axis_v,
    output wire          m_axis_tlast,
    output wire          m_axis_tvalid,
    input  wire          m_axis_tready,
    output wire [511:0]  m_sums_pp, m_sums_uu,
    output wire          m_sums_valid,
    input  wire          m_sums_ready,
    output wire [15:0]   latency
);

    localparam LAT = 5 * `L2L_FP32_MUL_LAT + 3 * `L2L_FP32_ADD_LAT + `L2L_FP32_SQRT_LAT + `L2L_FP32_DIV_LAT;

    assign latency = LAT;

    wire skid_ce, ce;
    assign ce = skid_ce && !m_sums_valid;
    assign s_axis_tready = ce;

    wire        lane_vld;
    wire [31:0] mp, vp, pp, uu;
    // pass 1 writes neither p nor u2 (pass 2 recomputes u2)
    /* verilator lint_off UNUSEDSIGNAL */
    wire [31:0] unused_p, unused_u2;
    /* verilator lint_on UNUSEDSIGNAL */
    l2l_eps_lamb_lane #(.PASS2(0), .DSP_SHAPE(DSP_SHAPE)) u_lane (
        .clk(clk), .rst(rst), .ce(ce),
        .b1(b1), .omb1(omb1), .b2(b2), .omb2(omb2), .inv_bc2_sqrt(inv_bc2_sqrt), .eps(eps),
        .inv_bc1(inv_bc1), .wd(wd),
        .in_valid(s_axis_tvalid), .decay_en(s_axis_decay),
        .g(s_axis_g), .p(s_axis_p), .m(s_axis_m), .v(s_axis_v),
        .out_valid(lane_vld), .m_out(mp), .v_out(vp), .p_out(unused_p), .u2_out(unused_u2),
        .pp_out(pp), .uu_out(uu));

    wire first_d, last_d;
    l2l_delay #(.WIDTH(2), .DEPTH(LAT)) d_side (.clk(clk), .rst(rst), .ce(ce),
        .d({s_axis_first, s_axis_last}), .q({first_d, last_d}));

    // ---- the two sums (they finish together: uu's valid is pp's) ----------------------
    // uu's sums_valid is pp's, cycle for cycle
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused_uu_valid;
    /* verilator lint_on UNUSEDSIGNAL */
    l2l_eps_lamb_acc u_acc_pp (.clk(clk), .rst(rst), .ce(ce), .in_valid(lane_vld), .in_first(first_d),
        .in_last(last_d), .in_x(pp), .sums_valid(m_sums_valid), .sums(m_sums_pp), .sums_ready(m_sums_ready));
    l2l_eps_lamb_acc u_acc_uu (.clk(clk), .rst(rst), .ce(ce), .in_valid(lane_vld), .in_first(first_d),
        .in_last(last_d), .in_x(uu), .sums_valid(unused_uu_valid), .sums(m_sums_uu), .sums_ready(m_sums_ready));

    // ---- element exit ------------------------------------------------------------------
    l2l_pipe_skid #(.WIDTH(65)) u_skid (
        .clk(clk), .rst(rst), .ce(skid_ce),
        .pipe_valid(lane_vld && ce),
        .pipe_data({last_d, vp, mp}),
        .m_valid(m_axis_tvalid),
        .m_data({m_axis_tlast, m_axis_v, m_axis_m}),
        .m_ready(m_axis_tready));

endmodule

`default_nettype wire
