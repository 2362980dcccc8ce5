// l2l_eps_reduce -- the streaming gradient reducer of the RTL EPS:
// K contributions -> binary32 g = ((g_0 + g_1) + ... + g_{K-1}) * inv_scale,
// the contract's left fold in contribution order, every sum and the scaling
// one rounded binary32 op (l2l_fp32_add, l2l_fp32_mul), plus the sticky
// finite flag of the layer.
//
// Input order: the layer in blocks of up to BLOCK beats; per block,
// contribution 0's beats, then contribution 1's beats for the same elements,
// ..., then contribution K-1's, tlast on the last beat of each contribution's
// segment. Output: one beat per block beat once the last contribution has been
// added, scaled, tlast at the end of the block; tkeep is the last
// contribution's. Lanes with tkeep = 0 are computed but never raise the flag.
//
// How:
//  * The accumulator is an on-chip buffer of BLOCK beats (LANES x 32 bits
//    each; block RAM with a registered read). Beat j of contribution k reads
//    acc[j], adds g_k[j] through one l2l_fp32_add per lane and, unless k is
//    the last contribution, writes the sum back to acc[j].
//  * Contribution 0 adds -0.0 instead of reading acc: x + (-0) == x exactly
//    for every binary32 x (+0 + -0 = +0, -0 + -0 = -0, subnormals exact, a NaN
//    stays a NaN), so acc = g_0 takes the same path and the same time as the
//    other contributions and K = 1 passes straight through (g_0 * inv_scale).
//  * bf16/fp16 gradients are widened by l2l_cvt_bf16_to_fp32 /
//    l2l_cvt_fp16_to_fp32 (exact); the accumulator read is delayed to match.
//  * Read-after-write hazard: when a segment is shorter than the adder
//    pipeline, beat j of contribution k+1 would read acc[j] before
//    contribution k's sum for j is written. The reducer stalls the input
//    (s_axis_tready = 0) until that write is done; no forwarding, so the
//    value read is always the written one (exact by construction). With
//    `inflight` = beats between the read and the write-back (FIFO order) and
//    j the beat index in the segment, contribution k's beats still in flight
//    are its last (inflight - j), so reading j is safe iff
//    inflight <= j or inflight < (length of the previous segment).
//    Segments of at least PRE + ADD_LAT beats never stall.
//  * Flow control as in l2l_eps_adamw: one clock enable for the pipeline,
//    driven by the skid register of l2l_pipe_skid, so s_axis_tready is
//    skid_empty && !hazard, from registers only: never a combinational function
//    of m_axis_tready. With m_axis_tready = 1 and segments >= the pipeline
//    depth the reducer takes one beat per clock.
//  * finite drops when an output element of a kept lane leaves the pipeline
//    with an all-ones exponent (inf or NaN); flag_clear sets it back to 1.
//
// Latency from the s_axis transfer of a last-contribution beat to m_axis:
// PRE + ADD_LAT + MUL_LAT, PRE = max(1, CVT_WIDEN_LAT) (16 with the current
// header), exposed as the constant output `latency`.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_reduce #(
    parameter LANES = 1,            // 1..16 elements per beat
    parameter GDTYPE = 0,           // gradient dtype: 0 fp32, 1 bf16, 2 fp16
    parameter BLOCK = 64,           // max beats per segment (size of the on-chip accumulator, beats)
    parameter DSP_SHAPE = 0         // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
) (
    input  wire                   clk, rst,
    input  wire [31:0]            inv_scale,
    input  wire [7:0]             k,              // contributions, >= 1, constant during a run
    input  wire [((GDTYPE == 0) ? 32 : 16)*LANES-1:0] s_axis_tdata,   // lane i in bits [GW*i +: GW]
    input  wire [LANES-1:0]       s_axis_tkeep,
    input  wire                   s_axis_tlast,
    input  wire                   s_axis_tvalid,
    output wire                   s_axis_tready,
    output wire [32*LANES-1:0]    m_axis_tdata,
    output wire [LANES-1:0]       m_axis_tkeep,
    output wire                   m_axis_tlast,   // end of block
    output wire                   m_axis_tvalid,
    input  wire                   m_axis_tready,
    input  wire                   flag_clear,     // pulse before a layer: finite <= 1
    output reg                    finite,         // sticky: 0 once any kept output element is inf or NaN
    output wire [15:0]            latency         // a constant: s_axis (last contribution) to m_axis, ce-cycles
);

    localparam GW  = (GDTYPE == 0) ? 32 : 16;
    localparam WL  = (GDTYPE == 0) ? 0 : `L2L_CVT_WIDEN_LAT;   // widening latency
    localparam PRE = (WL > 1) ? WL : 1;                         // acc read (1) and widening, aligned
    localparam LA  = `L2L_FP32_ADD_LAT;
    localparam LM  = `L2L_FP32_MUL_LAT;
    localparam LAT = PRE + LA + LM;

    function integer clog2;
        input integer x;
        integer r;
        begin
            r = 0;
            while ((1 << r) < x)
                r = r + 1;
            clog2 = r;
        end
    endfunction

    localparam AW = (BLOCK > 1) ? clog2(BLOCK) : 1;     // accumulator address bits
    // the beat counters (0..BLOCK) and the inflight counter (0..PRE+LA+1) compare with each
    // other, so they share one width: the larger of the two needed
    localparam JW0 = clog2(BLOCK + 1) + 1;
    localparam FW0 = clog2(PRE + LA + 2) + 1;
    localparam JW  = (JW0 > FW0) ? JW0 : FW0;
    localparam FW  = JW;
    localparam [JW-1:0] BLOCK_J = BLOCK[JW-1:0];

    initial begin
        if (LANES < 1 || LANES > 16) begin
            $error("l2l_eps_reduce: illegal LANES=%0d (1..16)", LANES);
            $finish;
        end
        if (GDTYPE < 0 || GDTYPE > 2) begin
            $error("l2l_eps_reduce: illegal GDTYPE=%0d (0 fp32, 1 bf16, 2 fp16)", GDTYPE);
            $finish;
        end
        if (BLOCK < 1 || BLOCK > 65536) begin
            $error("l2l_eps_reduce: illegal BLOCK=%0d (1..65536)", BLOCK);
            $finish;
        end
    end

    assign latency = LAT;

    // ---- control -------------------------------------------------------------------
    wire ce;                                // pipeline clock enable (from the skid register)
    reg  [7:0]    kc;                       // contribution of the current segment
    reg  [JW-1:0] j;                        // beat index inside the segment
    reg  [JW-1:0] lprev;                    // length of the previous segment
    reg  [FW-1:0] inflight;                 // beats accepted, sum not yet written back

    wire [7:0] klast    = (k <= 8'd1) ? 8'd0 : k - 8'd1;
    wire       is_first = (kc == 8'd0);
    wire       is_last  = (kc == klast);
    wire       hazard   = !is_first && (inflight > j) && (inflight >= lprev);
    assign s_axis_tready = ce && !hazard;
    wire       accept   = s_axis_tvalid && s_axis_tready;

    wire       add_valid;                   // adder output, lane 0 (all lanes alike)
    wire       wr_side;                     // that beat writes back (not the last contribution)
    wire       retire   = ce && add_valid;  // the beat leaves the adder this edge

    always @(posedge clk) begin
        if (rst) begin
            kc       <= 8'd0;
            j        <= {JW{1'b0}};
            lprev    <= {JW{1'b0}};
            inflight <= {FW{1'b0}};
        end else begin
            if (accept) begin
                if (s_axis_tlast) begin
                    j     <= {JW{1'b0}};
                    lprev <= j + 1'b1;
                    kc    <= is_last ? 8'd0 : kc + 8'd1;
                end else begin
                    j <= j + 1'b1;
                end
            end
            inflight <= inflight + {{(FW - 1){1'b0}}, accept} - {{(FW - 1){1'b0}}, retire};
        end
    end

`ifndef SYNTHESIS
    // simulation only: a segment longer than the accumulator is a protocol error
    always @(posedge clk) begin
        if (!rst && accept && j >= BLOCK_J) begin
            $display("l2l_eps_reduce: segment longer than BLOCK=%0d beats at %0t", BLOCK, $time);
            $finish;
        end
    end
`endif

    // ---- accumulator buffer ---------------------------------------------------------
    reg  [32*LANES-1:0] acc_mem [0:BLOCK-1];
    reg  [32*LANES-1:0] acc_rd;
    wire [AW-1:0]       rd_addr = j[AW-1:0];
    wire [AW-1:0]       wr_addr;
    wire [32*LANES-1:0] sum;

    always @(posedge clk) begin
        if (ce)
            acc_rd <= acc_mem[rd_addr];
        if (ce && add_valid && wr_side)
            acc_mem[wr_addr] <= sum;
    end

    wire [32*LANES-1:0] acc_al;         // acc aligned with the widened gradient
    l2l_delay #(.WIDTH(32 * LANES), .DEPTH(PRE - 1)) d_acc (
        .clk(clk), .rst(rst), .ce(ce), .d(acc_rd), .q(acc_al));

    // sidebands to the adder input (PRE), to the adder output (PRE + LA), to the exit (LAT)
    wire first_al;
    l2l_delay #(.WIDTH(1), .DEPTH(PRE)) d_first (
        .clk(clk), .rst(rst), .ce(ce), .d(is_first), .q(first_al));
    wire valid_al;
    l2l_delay #(.WIDTH(1), .DEPTH(PRE), .RESET(1)) d_valid (
        .clk(clk), .rst(rst), .ce(ce), .d(accept), .q(valid_al));
    wire [LANES-1:0] keep_s;
    wire             last_s, lastk_s;
    l2l_delay #(.WIDTH(AW + LANES + 3), .DEPTH(PRE + LA)) d_side (
        .clk(clk), .rst(rst), .ce(ce),
        .d({!is_last, is_last, s_axis_tlast, s_axis_tkeep, rd_addr}),
        .q({wr_side, lastk_s, last_s, keep_s, wr_addr}));
    wire [LANES-1:0] keep_o;
    wire             last_o;
    l2l_delay #(.WIDTH(LANES + 1), .DEPTH(LM)) d_side2 (
        .clk(clk), .rst(rst), .ce(ce), .d({last_s, keep_s}), .q({last_o, keep_o}));

    // ---- the lanes ---------------------------------------------------------------------
    wire [LANES-1:0]    lane_add_valid;
    // every lane carries the same valid chain: lane 0's out_valid is the pipeline's (the
    // others are left for synthesis to trim)
    /* verilator lint_off UNUSEDSIGNAL */
    wire [LANES-1:0]    lane_out_valid;
    /* verilator lint_on UNUSEDSIGNAL */
    wire [32*LANES-1:0] g_out;

    genvar i;
    generate
        for (i = 0; i < LANES; i = i + 1) begin : g_lane
            wire [GW-1:0] g_raw = s_axis_tdata[GW*i +: GW];
            wire [31:0]   g_w;              // widened, WL after the transfer
            wire [31:0]   g_al;             // aligned with acc_al (PRE)
            if (GDTYPE == 0) begin : g_f32
                assign g_w = g_raw;
            end else if (GDTYPE == 1) begin : g_bf16
                wire unused_v;
                l2l_cvt_bf16_to_fp32 u_w (.clk(clk), .rst(rst), .ce(ce), .in_valid(accept), .a(g_raw),
                                          .out_valid(unused_v), .y(g_w));
            end else begin : g_f16
                wire unused_v;
                l2l_cvt_fp16_to_fp32 u_w (.clk(clk), .rst(rst), .ce(ce), .in_valid(accept), .a(g_raw),
                                          .out_valid(unused_v), .y(g_w));
            end
            l2l_delay #(.WIDTH(32), .DEPTH(PRE - WL)) d_g (
                .clk(clk), .rst(rst), .ce(ce), .d(g_w), .q(g_al));

            // acc + g_k; contribution 0 adds -0 (exact identity) instead of reading acc
            wire [31:0] a_op = first_al ? 32'h8000_0000 : acc_al[32*i +: 32];
            l2l_fp32_add u_add (.clk(clk), .rst(rst), .ce(ce), .in_valid(valid_al),
                                .a(a_op), .b(g_al), .sub(1'b0),
                                .out_valid(lane_add_valid[i]), .y(sum[32*i +: 32]));

            // after the last contribution: * inv_scale
            l2l_fp32_mul #(.DSP_SHAPE(DSP_SHAPE)) u_scale (.clk(clk), .rst(rst), .ce(ce),
                                                           .in_valid(lane_add_valid[i] && lastk_s),
                                                           .a(sum[32*i +: 32]), .b(inv_scale),
                                                           .out_valid(lane_out_valid[i]), .y(g_out[32*i +: 32]));
        end
    endgenerate

    assign add_valid = lane_add_valid[0];

    // ---- finite flag: kept output elements with an all-ones exponent --------------------
    reg [LANES-1:0] nonfinite;
    integer l;
    always @(*) begin
        for (l = 0; l < LANES; l = l + 1)
            nonfinite[l] = keep_o[l] && (g_out[32*l + 23 +: 8] == 8'hFF);
    end

    always @(posedge clk) begin
        if (rst || flag_clear)
            finite <= 1'b1;
        else if (ce && lane_out_valid[0] && (|nonfinite))
            finite <= 1'b0;
    end

    // ---- exit ------------------------------------------------------------------------
    l2l_pipe_skid #(.WIDTH(32 * LANES + LANES + 1)) u_skid (
        .clk(clk), .rst(rst), .ce(ce),
        .pipe_valid(lane_out_valid[0]),
        .pipe_data({last_o, keep_o, g_out}),
        .m_valid(m_axis_tvalid),
        .m_data({m_axis_tlast, m_axis_tkeep, m_axis_tdata}),
        .m_ready(m_axis_tready));

endmodule

`default_nettype wire
