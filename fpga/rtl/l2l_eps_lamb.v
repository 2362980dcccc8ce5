// l2l_eps_lamb -- the LAMB kernel's datapath (l2l_eps_kernel, OPTIMIZER = 2):
// either pass of docs/eps-numerics.md "LAMB update" on the kernel's joined
// beats, with the segment bookkeeping around l2l_eps_lamb_norms (pass 1) and
// l2l_eps_lamb_apply (pass 2).
//
// Pass 1 (pass2 = 0): each joined beat (reduced g, p, m, v, tkeep, decay bits)
// is taken apart into one element per clock for l2l_eps_lamb_norms, each
// element marked first / last of its segment from the segment ends
// (s_seg: seg[1], seg[2], ... as 32-bit words). Its m', v' are packed back
// into beats (m_axis_m, m_axis_v, tkeep; the layer's last beat partial), and
// each segment's sums leave as 32 / LANES beats of LANES words on m_sums:
// lane j of p*p's sums first, then of u2*u2's (the `sums` buffer's order,
// fpga/ARGS.md), so a write engine writes them to sums + 128 * segment.
//
// Pass 2 (pass2 = 1): the beats (p, m', v', tkeep, decay bits) go through
// l2l_eps_lamb_apply at one beat per clock, each lane with its segment's step
// size. The sizes come as (end, step) pairs, seg[s + 1] from s_seg and
// steps[s] from s_step; an expander builds a beat of LANES sizes per clock
// while at most one segment ends in the beat, one clock more per further end.
// Out: p' and the device copy (m_axis_p, m_axis_c, tkeep).
//
// Rules (the driver keeps them; fpga/ARGS.md): segments are non-empty and
// increasing, seg[nseg] = n, the segment ends are read from seg + 4 (seg[0] = 0
// is not read). `start` (one clock, arguments held from then on) forgets the
// last run's position; a run consumes exactly nseg ends (and nseg steps in
// pass 2), so nothing is left in a word stream between runs.
//
// Why one element per clock in pass 1: the contract's sums are 16 interleaved
// accumulators per segment (l2l_eps_lamb_norms); pass 2 is a plain map and
// runs at LANES elements per clock.
`default_nettype none

module l2l_eps_lamb #(
    parameter LANES  = 16,   // elements per beat, a power of two, 1 .. 16
    parameter GDTYPE = 0,    // gradient port's element (the steps come on it): 0 fp32, 1/2 16-bit
    parameter CDTYPE = 0,    // device copy dtype (the segment ends come on its port): 0 fp32, 1 bf16, 2 fp16
    parameter DSP_SHAPE = 0, // multiplier pieces: 0 18x18 (ECP5), 1 27x18 (Xilinx DSP48E2); l2l_fp32_mul
    // element widths of those ports: fixed by the two above
    parameter GWP    = (GDTYPE == 0) ? 32 : 16,
    parameter CWP    = (CDTYPE == 0) ? 32 : 16
) (
    input  wire                   clk,
    input  wire                   rst,
    input  wire                   start,        // pulse: a run begins
    input  wire                   pass2,        // held during a run: 0 norms pass, 1 step pass
    input  wire [31:0]            n,            // elements, held
    input  wire [31:0]            b1, omb1, b2, omb2, inv_bc2_sqrt, eps, inv_bc1, wd,   // held
    // the joined beat (g unused in pass 2)
    input  wire [32*LANES-1:0]    s_axis_g, s_axis_p, s_axis_m, s_axis_v,
    input  wire [LANES-1:0]       s_axis_tkeep,
    input  wire [LANES-1:0]       s_axis_decay,
    input  wire                   s_axis_tvalid,
    output wire                   s_axis_tready,
    // segment ends, as read on copy's port
    input  wire [CWP*LANES-1:0]   s_seg_tdata,
    input  wire [LANES-1:0]       s_seg_tkeep,
    input  wire                   s_seg_tvalid,
    output wire                   s_seg_tready,
    // step sizes (pass 2), as read on gr's port
    input  wire [GWP*LANES-1:0]   s_step_tdata,
    input  wire [LANES-1:0]       s_step_tkeep,
    input  wire                   s_step_tvalid,
    output wire                   s_step_tready,
    // pass 1: m', v'; pass 2: p', copy
    output wire [32*LANES-1:0]    m_axis_p, m_axis_m, m_axis_v,
    output wire [CWP*LANES-1:0]   m_axis_c,
    output wire [LANES-1:0]       m_axis_tkeep,
    output wire                   m_axis_tvalid,
    input  wire                   m_axis_tready,
    // pass 1: the sums, LANES words a beat
    output wire [32*LANES-1:0]    m_sums_tdata,
    output wire                   m_sums_tvalid,
    input  wire                   m_sums_tready
);

    localparam DW  = 32 * LANES;
    localparam NB  = 32 / LANES;               // sums beats a segment

    initial begin
        if (LANES < 1 || LANES > 16 || (LANES & (LANES - 1)) != 0 || GDTYPE < 0 || GDTYPE > 2 ||
            CDTYPE < 0 || CDTYPE > 2 || GWP != ((GDTYPE == 0) ? 32 : 16) || CWP != ((CDTYPE == 0) ? 32 : 16)) begin
            $error("l2l_eps_lamb: illegal LANES=%0d GDTYPE=%0d CDTYPE=%0d", LANES, GDTYPE, CDTYPE);
            $finish;
        end
    end

    // ------------------------------------------------------------ the two word streams
    wire [31:0] seg_end, step_word;
    wire        seg_valid, step_valid;
    wire        seg_take, step_take;
    l2l_words_in #(.LANES(LANES), .EW(CWP)) u_seg_words (
        .clk(clk), .rst(rst), .clear(start),
        .s_tdata(s_seg_tdata), .s_tkeep(s_seg_tkeep), .s_tvalid(s_seg_tvalid), .s_tready(s_seg_tready),
        .m_word(seg_end), .m_valid(seg_valid), .m_ready(seg_take));
    l2l_words_in #(.LANES(LANES), .EW(GWP)) u_step_words (
        .clk(clk), .rst(rst), .clear(start),
        .s_tdata(s_step_tdata), .s_tkeep(s_step_tkeep), .s_tvalid(s_step_tvalid), .s_tready(s_step_tready),
        .m_word(step_word), .m_valid(step_valid), .m_ready(step_take));

    // the current segment: its end (and in pass 2 its step), loaded when empty or popped
    reg         cur_valid;
    reg  [31:0] cur_end, cur_step;
    wire        cur_pop;
    wire        pair_valid = seg_valid && (!pass2 || step_valid);
    wire        cur_load   = pair_valid && (!cur_valid || cur_pop);
    assign seg_take  = cur_load;
    assign step_take = cur_load && pass2;

    always @(posedge clk) begin
        if (rst || start) begin
            cur_valid <= 1'b0;
        end else begin
            if (cur_pop)
                cur_valid <= 1'b0;
            if (cur_load) begin
                cur_valid <= 1'b1;
                cur_end   <= seg_end;
                cur_step  <= step_word;
            end
        end
    end

    // ============================================================ pass 1
    // ---- a beat, one element at a time -------------------------------------------------
    reg  [DW-1:0]    sg, sp, sm, sv;
    reg  [LANES-1:0] skeep, sdec;
    reg              sbuf;                  // a beat is held
    reg  [4:0]       slane;                 // its element taken next
    reg  [31:0]      idx, seg_lo;           // that element's index, its segment's first
    wire [31:0]      skeep_ext = {{(32 - LANES){1'b0}}, skeep};
    wire [31:0]      sdec_ext  = {{(32 - LANES){1'b0}}, sdec};
    wire             last_lane = ({27'd0, slane} == LANES - 1) || !skeep_ext[slane + 5'd1];
    wire             nr_ready;
    wire             el_valid  = !pass2 && sbuf && cur_valid;
    wire             el_take   = el_valid && nr_ready;
    wire             el_last   = (idx + 32'd1 == cur_end);
    wire             p1_ready  = !sbuf || (el_take && last_lane);

    always @(posedge clk) begin
        if (rst || start) begin
            sbuf   <= 1'b0;
            slane  <= 5'd0;
            idx    <= 32'd0;
            seg_lo <= 32'd0;
        end else begin
            if (el_take) begin
                idx   <= idx + 32'd1;
                slane <= last_lane ? 5'd0 : slane + 5'd1;
                if (last_lane)
                    sbuf <= 1'b0;
                if (el_last)
                    seg_lo <= cur_end;
            end
            if (!pass2 && s_axis_tvalid && p1_ready) begin
                sbuf  <= 1'b1;
                sg    <= s_axis_g;
                sp    <= s_axis_p;
                sm    <= s_axis_m;
                sv    <= s_axis_v;
                skeep <= s_axis_tkeep;
                sdec  <= s_axis_decay;
            end
        end
    end

    // ---- the norms: m', v' and the segment sums -----------------------------------------
    wire [31:0]  nm_m, nm_v;
    wire         nm_valid, nm_ready;
    wire [511:0] sums_pp, sums_uu;
    wire         sums_valid, sums_ready;
    // tlast (segment end) and latency: the packer counts elements, the sequencer beats
    /* verilator lint_off PINCONNECTEMPTY */
    l2l_eps_lamb_norms #(.DSP_SHAPE(DSP_SHAPE)) u_norms (
        .clk(clk), .rst(rst),
        .b1(b1), .omb1(omb1), .b2(b2), .omb2(omb2), .inv_bc2_sqrt(inv_bc2_sqrt), .eps(eps),
        .inv_bc1(inv_bc1), .wd(wd),
        .s_axis_g(sg[32 * slane +: 32]), .s_axis_p(sp[32 * slane +: 32]),
        .s_axis_m(sm[32 * slane +: 32]), .s_axis_v(sv[32 * slane +: 32]),
        .s_axis_decay(sdec_ext[slane]), .s_axis_first(idx == seg_lo), .s_axis_last(el_last),
        .s_axis_tvalid(el_valid), .s_axis_tready(nr_ready),
        .m_axis_m(nm_m), .m_axis_v(nm_v), .m_axis_tlast(), .m_axis_tvalid(nm_valid), .m_axis_tready(nm_ready),
        .m_sums_pp(sums_pp), .m_sums_uu(sums_uu), .m_sums_valid(sums_valid), .m_sums_ready(sums_ready),
        .latency());
    /* verilator lint_on PINCONNECTEMPTY */

    // ---- m', v' packed into beats -----------------------------------------------------
    reg  [DW-1:0]    om, ov;
    reg  [LANES-1:0] okeep;
    reg              ovalid;
    reg  [4:0]       olane;
    reg  [31:0]      ocount;                // elements packed so far
    wire             o_take   = ovalid && m_axis_tready && !pass2;
    assign nm_ready = !ovalid || o_take;
    wire             d_take   = nm_valid && nm_ready;
    wire             d_full   = ({27'd0, olane} == LANES - 1) || (ocount + 32'd1 == n);

    always @(posedge clk) begin
        if (rst || start) begin
            ovalid <= 1'b0;
            olane  <= 5'd0;
            ocount <= 32'd0;
            om     <= {DW{1'b0}};     // a partial last beat's other lanes: defined, not written
            ov     <= {DW{1'b0}};
            okeep  <= {LANES{1'b0}};
        end else begin
            if (o_take)
                ovalid <= 1'b0;
            if (d_take) begin
                om[32 * olane +: 32] <= nm_m;
                ov[32 * olane +: 32] <= nm_v;
                okeep  <= (olane == 5'd0) ? {{(LANES - 1){1'b0}}, 1'b1} : okeep | ({{(LANES - 1){1'b0}}, 1'b1} << olane);
                ocount <= ocount + 32'd1;
                olane  <= d_full ? 5'd0 : olane + 5'd1;
                if (d_full)
                    ovalid <= 1'b1;
            end
        end
    end

    // ---- each segment's sums, NB beats -------------------------------------------------
    reg  [4:0]     sb;                        // the beat of the segment's sums offered
    wire [1023:0]  sums_all = {sums_uu, sums_pp};
    assign m_sums_tdata  = sums_all[DW * sb +: DW];
    assign m_sums_tvalid = sums_valid;
    assign sums_ready    = m_sums_tready && ({27'd0, sb} == NB - 1);
    always @(posedge clk) begin
        if (rst || start)
            sb <= 5'd0;
        else if (sums_valid && m_sums_tready)
            sb <= ({27'd0, sb} == NB - 1) ? 5'd0 : sb + 5'd1;
    end

    // ============================================================ pass 2
    // ---- a beat of step sizes per clock --------------------------------------------------
    reg  [DW-1:0]    bstep, st_out;           // the beat being built, the beat offered
    reg              st_valid;
    reg  [31:0]      base;                    // the first element of the beat being built
    reg  [4:0]       fill;                    // its lanes already given a step
    wire             ap_ready;
    wire             p2_fire  = pass2 && s_axis_tvalid && st_valid && ap_ready;
    wire             build    = pass2 && cur_valid && (!st_valid || p2_fire);
    wire [31:0]      rel      = cur_end - base;            // > fill
    wire             complete = (rel >= LANES) || (cur_end == n);
    assign cur_pop = pass2 ? (build && (rel <= LANES)) : (el_take && el_last);

    wire [DW-1:0] merged;
    genvar li;
    generate
        for (li = 0; li < LANES; li = li + 1) begin : g_step_lane
            assign merged[32 * li +: 32] = (li >= fill && li < rel) ? cur_step : bstep[32 * li +: 32];
        end
    endgenerate

    always @(posedge clk) begin
        if (rst || start) begin
            st_valid <= 1'b0;
            base     <= 32'd0;
            fill     <= 5'd0;
            bstep    <= {DW{1'b0}};   // the lanes past n in the last beat: defined, not written
            st_out   <= {DW{1'b0}};
        end else begin
            if (p2_fire)
                st_valid <= 1'b0;
            if (build) begin
                if (complete) begin
                    st_out   <= merged;
                    st_valid <= 1'b1;
                    base     <= base + LANES;
                    fill     <= 5'd0;
                end else begin
                    bstep <= merged;
                    fill  <= rel[4:0];
                end
            end
        end
    end

    // ---- the step pass's map ------------------------------------------------------------
    wire [DW-1:0]        ap_p;
    wire [CWP*LANES-1:0] ap_c;
    wire [LANES-1:0]     ap_keep;
    wire                 ap_valid;
    // tlast and latency: the write engines count beats
    /* verilator lint_off PINCONNECTEMPTY */
    l2l_eps_lamb_apply #(.LANES(LANES), .CDTYPE(CDTYPE), .DSP_SHAPE(DSP_SHAPE)) u_apply (
        .clk(clk), .rst(rst),
        .inv_bc2_sqrt(inv_bc2_sqrt), .eps(eps), .inv_bc1(inv_bc1), .wd(wd),
        .s_axis_p(s_axis_p), .s_axis_m(s_axis_m), .s_axis_v(s_axis_v), .s_axis_step(st_out),
        .s_axis_tkeep(s_axis_tkeep), .s_axis_decay(s_axis_decay), .s_axis_tlast(1'b0),
        .s_axis_tvalid(pass2 && s_axis_tvalid && st_valid), .s_axis_tready(ap_ready),
        .m_axis_p(ap_p), .m_axis_c(ap_c), .m_axis_tkeep(ap_keep), .m_axis_tlast(),
        .m_axis_tvalid(ap_valid), .m_axis_tready(m_axis_tready && pass2), .latency());
    /* verilator lint_on PINCONNECTEMPTY */

    // ============================================================ out
    assign s_axis_tready = pass2 ? (st_valid && ap_ready) : p1_ready;
    assign m_axis_p      = ap_p;
    assign m_axis_c      = ap_c;
    assign m_axis_m      = om;
    assign m_axis_v      = ov;
    assign m_axis_tkeep  = pass2 ? ap_keep : okeep;
    assign m_axis_tvalid = pass2 ? ap_valid : ovalid;

endmodule

`default_nettype wire
