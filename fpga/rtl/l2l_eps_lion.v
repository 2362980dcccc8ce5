// l2l_eps_lion -- the Lion datapath of the RTL EPS: LANES elements per clock,
// each through one l2l_eps_lion_lane (the contract's Lion operations in order,
// every product and sum one rounded binary32 op), then the device copy.
//
// The Lion counterpart of l2l_eps_adamw, with the same stream shape less v:
// input one joined beat of LANES elements each of the reduced gradient g and
// the state p, m (the kernel joins the reducer's output with its p/m reads);
// output p', m' and the copy of p' (CDTYPE: 0 fp32, 1 bf16, 2 fp16), with
// tkeep/tlast carried along unchanged. s_axis_decay says, per lane, whether
// that element is weight-decayed (its index in the entry is below n_decay).
// Lanes with tkeep = 0 are computed like the others and marked invalid on the
// output; the kernel does not write them.
//
// Flow control: as l2l_eps_adamw -- handshake-free lanes on one clock enable,
// l2l_pipe_skid at the exit so that the enable, and s_axis_tready, is a
// flip-flop (never a combinational function of m_axis_tready); one beat per
// clock while m_axis_tready is held at 1.
//
// Latency (s_axis transfer to m_axis_tvalid, no stalls): LAT ce-cycles, with
// LAT = MUL + 2*ADD + 1 (+ NARROW when CDTYPE != 0); 23 / 26 with the current
// l2l_fp_latency.vh. Exposed as the LATENCY output (a constant).
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_lion #(
    parameter LANES = 1,            // 1..16 elements per beat
    parameter CDTYPE = 0,           // device copy dtype: 0 fp32, 1 bf16, 2 fp16 (CW = 32 or 16)
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire                   clk, rst,
    input  wire [31:0]            decay, b1, omb1, b2, omb2, neg_lr,   // Lion's step scalars, held constant during a run
    // one joined beat: LANES elements each of the reduced gradient g and the state p, m
    input  wire [32*LANES-1:0]    s_axis_g, s_axis_p, s_axis_m,
    input  wire [LANES-1:0]       s_axis_tkeep,
    input  wire [LANES-1:0]       s_axis_decay,   // per lane: 1 p1 = p * decay, 0 p1 = p (past n_decay)
    input  wire                   s_axis_tlast,
    input  wire                   s_axis_tvalid,
    output wire                   s_axis_tready,
    output wire [32*LANES-1:0]    m_axis_p, m_axis_m,
    output wire [((CDTYPE == 0) ? 32 : 16)*LANES-1:0] m_axis_c,   // device copy of p'
    output wire [LANES-1:0]       m_axis_tkeep,
    output wire                   m_axis_tlast,
    output wire                   m_axis_tvalid,
    input  wire                   m_axis_tready,
    output wire [15:0]            latency       // LAT, a constant (s_axis to m_axis, ce-cycles)
);

    localparam CW  = (CDTYPE == 0) ? 32 : 16;
    localparam LAT = `L2L_FP32_MUL_LAT + 2 * `L2L_FP32_ADD_LAT + 1
                     + ((CDTYPE == 0) ? 0 : `L2L_CVT_NARROW_LAT);
    // payload of one output beat, as it sits in the skid register
    localparam PW  = (2 * 32 + CW) * LANES + LANES + 1;

    initial begin
        if (LANES < 1 || LANES > 16) begin
            $error("l2l_eps_lion: illegal LANES=%0d (1..16)", LANES);
            $finish;
        end
        if (CDTYPE < 0 || CDTYPE > 2) begin
            $error("l2l_eps_lion: illegal CDTYPE=%0d (0 fp32, 1 bf16, 2 fp16)", CDTYPE);
            $finish;
        end
    end

    assign latency = LAT;

    wire ce;
    assign s_axis_tready = ce;      // ce: a flip-flop (skid register empty)

    // ---- the lanes --------------------------------------------------------------
    // every lane carries the same valid chain: lane 0's is the pipeline's (the others are
    // left for synthesis to trim)
    /* verilator lint_off UNUSEDSIGNAL */
    wire [LANES-1:0]      lane_valid;
    /* verilator lint_on UNUSEDSIGNAL */
    wire [32*LANES-1:0]   pp, mp;
    wire [CW*LANES-1:0]   cc;

    genvar i;
    generate
        for (i = 0; i < LANES; i = i + 1) begin : g_lane
            l2l_eps_lion_lane #(.CDTYPE(CDTYPE), .DSP_SHAPE(DSP_SHAPE)) u_lane (
                .clk(clk), .rst(rst), .ce(ce),
                .decay(decay), .b1(b1), .omb1(omb1), .b2(b2), .omb2(omb2), .neg_lr(neg_lr),
                .in_valid(s_axis_tvalid),   // sampled only when ce = 1 = s_axis_tready
                .decay_en(s_axis_decay[i]),
                .g(s_axis_g[32*i +: 32]), .p(s_axis_p[32*i +: 32]), .m(s_axis_m[32*i +: 32]),
                .out_valid(lane_valid[i]),
                .p_out(pp[32*i +: 32]), .m_out(mp[32*i +: 32]),
                .c_out(cc[CW*i +: CW]));
        end
    endgenerate

    // ---- sidebands ride along ---------------------------------------------------
    wire [LANES-1:0] keep_d;
    wire             last_d;
    l2l_delay #(.WIDTH(LANES + 1), .DEPTH(LAT)) d_side (
        .clk(clk), .rst(rst), .ce(ce), .d({s_axis_tlast, s_axis_tkeep}), .q({last_d, keep_d}));

    // ---- exit ------------------------------------------------------------------------
    l2l_pipe_skid #(.WIDTH(PW)) u_skid (
        .clk(clk), .rst(rst), .ce(ce),
        .pipe_valid(lane_valid[0]),
        .pipe_data({last_d, keep_d, cc, mp, pp}),
        .m_valid(m_axis_tvalid),
        .m_data({m_axis_tlast, m_axis_tkeep, m_axis_c, m_axis_m, m_axis_p}),
        .m_ready(m_axis_tready));

endmodule

`default_nettype wire
