// l2l_eps_lamb_apply -- LAMB's second pass in the RTL EPS (docs/eps-numerics.md
// "LAMB update"): LANES elements per clock, each u2 again from p, m', v'
// (l2l_eps_lamb_lane with PASS2 = 1: the same operations as pass 1, so the
// same bits), then
//
//     ns = step * u2        p' = p + ns        c = p' in the copy dtype
//
// each one rounded binary32 operation. Pass 2 has no sums, so unlike pass 1 it
// runs at LANES elements per clock.
//
// Input: one beat of LANES elements of p, m', v' and, per lane, its segment's
// step size (s_axis_step, lane i at [32i +: 32]: the caller looks up the
// segment of each element, a segment boundary can fall inside a beat) and its
// decay bit (index below n_decay). Output: p' and its device copy (CDTYPE: 0
// fp32, 1 bf16, 2 fp16), tkeep / tlast carried along. Flow control as
// l2l_eps_adamw (l2l_pipe_skid at the exit, s_axis_tready a flip-flop).
//
// Latency: LAT = 3*MUL + 2*ADD + SQRT + DIV + MUL + ADD (+ NARROW when
// CDTYPE != 0); 110 / 113 at the current l2l_fp_latency.vh (the LATENCY output).
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_lamb_apply #(
    parameter LANES = 1,            // 1..16 elements per beat
    parameter CDTYPE = 0,           // device copy dtype: 0 fp32, 1 bf16, 2 fp16
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire                   clk, rst,
    input  wire [31:0]            inv_bc2_sqrt, eps, inv_bc1, wd,   // held during a run
    input  wire [32*LANES-1:0]    s_axis_p, s_axis_m, s_axis_v, s_axis_step,
    input  wire [LANES-1:0]       s_axis_tkeep,
    input  wire [LANES-1:0]       s_axis_decay,
    input  wire                   s_axis_tlast,
    input  wire                   s_axis_tvalid,
    output wire                   s_axis_tready,
    output wire [32*LANES-1:0]    m_axis_p,
    output wire [((CDTYPE == 0) ? 32 : 16)*LANES-1:0] m_axis_c,
    output wire [LANES-1:0]       m_axis_tkeep,
    output wire                   m_axis_tlast,
    output wire                   m_axis_tvalid,
    input  wire                   m_axis_tready,
    output wire [15:0]            latency
);

    localparam CW  = (CDTYPE == 0) ? 32 : 16;
    localparam LM  = `L2L_FP32_MUL_LAT;
    localparam LA  = `L2L_FP32_ADD_LAT;
    localparam LU  = 3 * LM + 2 * LA + `L2L_FP32_SQRT_LAT + `L2L_FP32_DIV_LAT;   // the lane's u2
    localparam LN  = (CDTYPE == 0) ? 0 : `L2L_CVT_NARROW_LAT;
    localparam LAT = LU + LM + LA + LN;
    localparam PW  = (32 + CW) * LANES + LANES + 1;

    initial begin
        if (LANES < 1 || LANES > 16) begin
            $error("l2l_eps_lamb_apply: illegal LANES=%0d (1..16)", LANES);
            $finish;
        end
        if (CDTYPE < 0 || CDTYPE > 2) begin
            $error("l2l_eps_lamb_apply: illegal CDTYPE=%0d (0 fp32, 1 bf16, 2 fp16)", CDTYPE);
            $finish;
        end
    end

    assign latency = LAT;

    wire ce;
    assign s_axis_tready = ce;

    // every lane carries the same valid chain: lane 0's is the pipeline's
    /* verilator lint_off UNUSEDSIGNAL */
    wire [LANES-1:0]      lane_valid;
    /* verilator lint_on UNUSEDSIGNAL */
    wire [32*LANES-1:0]   pn;
    wire [CW*LANES-1:0]   cc;

    genvar i;
    generate
        for (i = 0; i < LANES; i = i + 1) begin : g_lane
            wire        u2_vld, ns_vld, pn_vld;
            wire [31:0] u2, p_d, st_d, ns, p_dd, pp;
            // pass 2 needs u2 and p only: the moments pass through, the squares are pass 1's
            /* verilator lint_off UNUSEDSIGNAL */
            wire [31:0] unused_m, unused_v, unused_pp, unused_uu;
            /* verilator lint_on UNUSEDSIGNAL */
            l2l_eps_lamb_lane #(.PASS2(1), .DSP_SHAPE(DSP_SHAPE)) u_lane (
                .clk(clk), .rst(rst), .ce(ce),
                .b1(32'd0), .omb1(32'd0), .b2(32'd0), .omb2(32'd0),
                .inv_bc2_sqrt(inv_bc2_sqrt), .eps(eps), .inv_bc1(inv_bc1), .wd(wd),
                .in_valid(s_axis_tvalid), .decay_en(s_axis_decay[i]),
                .g(32'd0), .p(s_axis_p[32*i +: 32]), .m(s_axis_m[32*i +: 32]), .v(s_axis_v[32*i +: 32]),
                .out_valid(u2_vld), .m_out(unused_m), .v_out(unused_v), .p_out(p_d), .u2_out(u2),
                .pp_out(unused_pp), .uu_out(unused_uu));
            l2l_delay #(.WIDTH(32), .DEPTH(LU)) d_st (.clk(clk), .rst(rst), .ce(ce),
                .d(s_axis_step[32*i +: 32]), .q(st_d));
            l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_ns (.clk(clk), .rst(rst), .ce(ce), .in_valid(u2_vld), .a(st_d), .b(u2),
                                                        .out_valid(ns_vld), .y(ns));
            l2l_delay #(.WIDTH(32), .DEPTH(LM)) d_p (.clk(clk), .rst(rst), .ce(ce), .d(p_d), .q(p_dd));
            l2l_fp32_add u_pn (.clk(clk), .rst(rst), .ce(ce), .in_valid(ns_vld), .a(p_dd), .b(ns), .sub(1'b0),
                               .out_valid(pn_vld), .y(pp));
            l2l_delay #(.WIDTH(32), .DEPTH(LN)) d_po (.clk(clk), .rst(rst), .ce(ce), .d(pp), .q(pn[32*i +: 32]));
            if (CDTYPE == 0) begin : g_c32
                assign cc[CW*i +: CW] = pp;
                assign lane_valid[i]  = pn_vld;
            end else if (CDTYPE == 1) begin : g_cbf16
                l2l_cvt_fp32_to_bf16 u_c (.clk(clk), .rst(rst), .ce(ce), .in_valid(pn_vld), .a(pp),
                                          .out_valid(lane_valid[i]), .y(cc[CW*i +: CW]));
            end else begin : g_cf16
                l2l_cvt_fp32_to_fp16 u_c (.clk(clk), .rst(rst), .ce(ce), .in_valid(pn_vld), .a(pp),
                                          .out_valid(lane_valid[i]), .y(cc[CW*i +: CW]));
            end
        end
    endgenerate

    wire [LANES-1:0] keep_d;
    wire             last_d;
    l2l_delay #(.WIDTH(LANES + 1), .DEPTH(LAT)) d_side (
        .clk(clk), .rst(rst), .ce(ce), .d({s_axis_tlast, s_axis_tkeep}), .q({last_d, keep_d}));

    l2l_pipe_skid #(.WIDTH(PW)) u_skid (
        .clk(clk), .rst(rst), .ce(ce),
        .pipe_valid(lane_valid[0]),
        .pipe_data({last_d, keep_d, cc, pn}),
        .m_valid(m_axis_tvalid),
        .m_data({m_axis_tlast, m_axis_tkeep, m_axis_c, m_axis_p}),
        .m_ready(m_axis_tready));

endmodule

`default_nettype wire
