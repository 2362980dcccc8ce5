// l2l_eps_adamw -- the AdamW datapath of the RTL EPS: LANES elements per
// clock, each through one l2l_eps_lane (the contract's operations in order,
// every product and sum one rounded binary32 op), then the device copy.
//
// Input: one joined beat of LANES elements each of the reduced gradient g and
// the state p, m, v (the kernel joins the reducer's output with its p/m/v
// reads). Output: p', m', v' and the copy of p' (CDTYPE: 0 fp32, 1 bf16,
// 2 fp16), with tkeep/tlast carried along unchanged. s_axis_decay says, per
// lane, whether that element is weight-decayed (the parameter groups: its
// index in the entry is below n_decay; the kernel derives it from its element
// count). Lanes with tkeep = 0 are
// computed like the others (their values are whatever came in) and are marked
// invalid on the output; the kernel does not write them.
//
// Flow control (why it looks like this): the lanes are handshake-free
// pipelines of fixed latency that advance on one clock enable. The exit goes
// through l2l_pipe_skid, whose single skid register makes that enable, and so
// s_axis_tready, a flip-flop output (skid register empty): s_axis_tready never
// depends combinationally on m_axis_tready. With m_axis_tready held at 1 the
// datapath takes one beat every clock (LANES elements per clock); when the
// consumer stalls, the pipeline freezes one beat later and resumes one clock
// after the consumer takes the held beat.
//
// Latency (s_axis transfer to m_axis_tvalid, no stalls): LAT ce-cycles, with
// LAT = 4*MUL + 3*ADD + SQRT + DIV (+ NARROW when CDTYPE != 0); 110 / 113 with
// the current l2l_fp_latency.vh. Exposed as the LATENCY output for the kernel
// (a constant).
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_adamw #(
    parameter LANES = 1,            // 1..16 elements per beat
    parameter CDTYPE = 0,           // device copy dtype: 0 fp32, 1 bf16, 2 fp16 (CW = 32 or 16)
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire                   clk, rst,
    input  wire [31:0]            decay, b1, omb1, b2, omb2, inv_bc2_sqrt, eps, neg_step,  // step scalars, held constant during a run
    // one joined beat: LANES elements each of the reduced gradient g and the state p, m, v
    input  wire [32*LANES-1:0]    s_axis_g, s_axis_p, s_axis_m, s_axis_v,
    input  wire [LANES-1:0]       s_axis_tkeep,
    input  wire [LANES-1:0]       s_axis_decay,   // per lane: 1 p1 = p * decay, 0 p1 = p (past n_decay)
    input  wire                   s_axis_tlast,
    input  wire                   s_axis_tvalid,
    output wire                   s_axis_tready,
    output wire [32*LANES-1:0]    m_axis_p, m_axis_m, m_axis_v,
    output wire [((CDTYPE == 0) ? 32 : 16)*LANES-1:0] m_axis_c,   // device copy of p'
    output wire [LANES-1:0]       m_axis_tkeep,
    output wire                   m_axis_tlast,
    output wire                   m_axis_tvalid,
    input  wire                   m_axis_tready,
    output wire [15:0]            latency       // LAT, a constant (s_axis to m_axis, ce-cycles)
);

    localparam CW  = (CDTYPE == 0) ? 32 : 16;
    localparam LAT = 4 * `L2L_FP32_MUL_LAT + 3 * `L2L_FP32_ADD_LAT + `L2L_FP32_SQRT_LAT
                     + `L2L_FP32_DIV_LAT + ((CDTYPE == 0) ? 0 : `L2L_CVT_NARROW_LAT);
    // payload of one output beat, as it sits in the skid register
    localparam PW  = (3 * 32 + CW) * LANES + LANES + 1;

    initial begin
        if (LANES < 1 || LANES > 16) begin
            $error("l2l_eps_adamw: illegal LANES=%0d (1..16)", LANES);
            $finish;
        end
        if (CDTYPE < 0 || CDTYPE > 2) begin
            $error("l2l_eps_adamw: illegal CDTYPE=%0d (0 fp32, 1 bf16, 2 fp16)", CDTYPE);
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
    wire [32*LANES-1:0]   pp, mp, vp;
    wire [CW*LANES-1:0]   cc;

    genvar i;
    generate
        for (i = 0; i < LANES; i = i + 1) begin : g_lane
            l2l_eps_lane #(.CDTYPE(CDTYPE), .DSP_SHAPE(DSP_SHAPE)) u_lane (
                .clk(clk), .rst(rst), .ce(ce),
                .decay(decay), .b1(b1), .omb1(omb1), .b2(b2), .omb2(omb2),
                .inv_bc2_sqrt(inv_bc2_sqrt), .eps(eps), .neg_step(neg_step),
                .in_valid(s_axis_tvalid),   // sampled only when ce = 1 = s_axis_tready
                .decay_en(s_axis_decay[i]),
                .g(s_axis_g[32*i +: 32]), .p(s_axis_p[32*i +: 32]),
                .m(s_axis_m[32*i +: 32]), .v(s_axis_v[32*i +: 32]),
                .out_valid(lane_valid[i]),
                .p_out(pp[32*i +: 32]), .m_out(mp[32*i +: 32]), .v_out(vp[32*i +: 32]),
                .c_out(cc[CW*i +: CW]));
        end
    endgenerate

    // ---- sidebands ride along ---------------------------------------------------
    wire [LANES-1:0] keep_d;
    wire             last_d;
    l2l_delay #(.WIDTH(LANES + 1), .DEPTH(LAT)) d_side (
        .clk(clk), .rst(rst), .ce(ce), .d({s_axis_tlast, s_axis_tkeep}), .q({last_d, keep_d}));

    // ---- exit ------------------------------------------------------------------------
    // every lane carries the same valid chain; lane 0's is the pipeline's
    l2l_pipe_skid #(.WIDTH(PW)) u_skid (
        .clk(clk), .rst(rst), .ce(ce),
        .pipe_valid(lane_valid[0]),
        .pipe_data({last_d, keep_d, cc, vp, mp, pp}),
        .m_valid(m_axis_tvalid),
        .m_data({m_axis_tlast, m_axis_tkeep, m_axis_c, m_axis_v, m_axis_m, m_axis_p}),
        .m_ready(m_axis_tready));

endmodule

`default_nettype wire
