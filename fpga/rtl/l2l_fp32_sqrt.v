// l2l_fp32_sqrt -- IEEE-754 binary32 square root y = sqrt(a), correctly
// rounded (round to nearest, ties to even), fully pipelined: one operation
// accepted on every clock-enabled cycle, result after `L2L_FP32_SQRT_LAT
// cycles.
//
// Why: the EPS AdamW step takes sqrt(v') once per element; the numerical
// contract wants exactly the bits of NumPy's float32 sqrt (no approximation,
// subnormal v' kept), at one element per clock per lane.
//
// How: a subnormal operand is normalised (leading-zero count, then shift) to
// m * 2^E with m in [1, 2); an odd E moves one factor 2 into m, so m lies in
// [1, 4) and E is even. The 25-bit root of M = m * 2^48 (1 integer bit, 23
// fraction bits and the round bit) comes from an unrolled radix-2 restoring
// digit recurrence, one root bit per stage:
//     R' = 4R + next two radicand bits;  T = 4Q + 1;
//     R' >= T ?  (R = R' - T, Q = 2Q + 1)  :  (R = R', Q = 2Q)
// Iteration j works at its own width (j+3 bits, 27 at the last one).
// The final remainder is the sticky bit; the last iteration decides
// "remainder != 0" beside its subtraction (R' != T or R' != 0, compares
// with no carry chain) and passes on that bit alone. The root of a binary32 never falls
// in the subnormal range nor overflows, and it never lies exactly halfway
// between two binary32 values (a set round bit always comes with a nonzero
// remainder); the rounding is still the full nearest-even rule,
// round & (sticky | lsb), added to {exponent, fraction}.
//
// Stages (each registered, all advanced by ce):
//   1       classify (zero/subnormal/inf/NaN/negative), leading zeros,
//           whole-byte part of the normalising shift
//   2       rest of the normalising shift (0..7 bits), exponent halving,
//           radicand alignment
//   3..27   25 root bits, one per stage
//           (the last one also makes the sticky bit)
//   28      round to nearest even, special cases -> y
//
// Timing (yosys synth_ecp5, nextpnr-ecp5 --85k, out of context): every
// stage is one carry chain of at most 31 bits plus a LUT level or two, or a
// few LUT levels with no carry chain. The slowest stage is a root-bit
// iteration (27-bit subtract, then select); 176-182 MHz over nextpnr seeds
// 1-3, where a registered 32-bit adder reaches ~277 MHz.
//
// Special cases: NaN in and sqrt(x < 0) (including -inf, negative
// subnormals) give the canonical quiet NaN 0x7FC00000; sqrt(+-0) = +-0;
// sqrt(+inf) = +inf.
//
// Interface and latency: fpga/rtl/README.md, l2l_fp_latency.vh. rst is
// synchronous and clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_fp32_sqrt (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [31:0] a,
    output wire        out_valid,
    output wire [31:0] y
);

    // root bits: 1 integer + 23 fraction + 1 round
    localparam NR    = 25;
    // pipeline depth: classify, normalise, NR root bits, round
    localparam DEPTH = 2 + NR + 1;

    localparam [1:0] SP_NONE = 2'd0, SP_ZERO = 2'd1, SP_INF = 2'd2, SP_NAN = 2'd3;

    initial begin
        if (DEPTH != `L2L_FP32_SQRT_LAT) begin
            $error("l2l_fp32_sqrt: pipeline depth %0d != L2L_FP32_SQRT_LAT %0d",
                   DEPTH, `L2L_FP32_SQRT_LAT);
            $finish;
        end
    end

    `include "l2l_lzc.vh"

    // ------------------------------------------------------------------
    // stage 1: classify, leading zeros, whole-byte part of the normalising
    // shift
    // ------------------------------------------------------------------
    wire [7:0]  ea     = a[30:23];
    wire [22:0] fa     = a[22:0];
    wire        a_emax = (ea == 8'hFF);
    wire        a_fz   = (fa == 23'd0);
    wire        a_zero = (ea == 8'd0) & a_fz;
    wire        is_nan = (a_emax & ~a_fz) | (a[31] & ~a_zero);
    wire        is_inf = ~is_nan & a_emax;           // +inf
    wire [23:0] ma0    = {ea != 8'd0, fa};

    reg        s1_v;
    reg        s1_sign;
    reg [1:0]  s1_sp;
    reg [23:0] s1_m;
    reg [4:0]  s1_lz;
    reg [7:0]  s1_e;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_sign <= a[31];
            s1_sp   <= is_nan ? SP_NAN : is_inf ? SP_INF : a_zero ? SP_ZERO : SP_NONE;
            s1_m    <= byte_norm(ma0);
            s1_lz   <= lzc24(ma0);
            // a subnormal has the exponent of the smallest normal
            s1_e    <= (ea == 8'd0) ? 8'd1 : ea;
        end
    end

    // ------------------------------------------------------------------
    // stage 2: normalise; t = (e - lz) + 127 = E + 254 (E unbiased) lies in
    // [105, 381]; E has the parity of t, the result's biased exponent is
    // floor(t / 2). Radicand M = m * 2^48 = mn << (25 + odd); its top 26
    // bits M[49:24] = mn << (1 + odd), the rest is zero.
    // ------------------------------------------------------------------
    wire [23:0] mn = s1_m << s1_lz[2:0];   // stage 1 shifted the whole bytes
    wire [8:0]  t  = {1'b0, s1_e} - {4'd0, s1_lz} + 9'd127;

    reg        s2_v;
    reg        s2_sign;
    reg [1:0]  s2_sp;
    reg [7:0]  s2_er;
    reg [25:0] s2_rad;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_sign <= s1_sign;
            s2_sp   <= s1_sp;
            s2_er   <= t[8:1];
            s2_rad  <= t[0] ? {mn, 2'b00} : {1'b0, mn, 1'b0};
        end
    end

    // ------------------------------------------------------------------
    // stages 3 .. 2+NR: one root bit each. Element j of each array is the
    // state before iteration j (element 0: stage 2, R = Q = 0). Before
    // iteration j, Q has j bits and R <= 2Q has j+1 bits (the arrays hold
    // them zero-extended). Radicand pairs j >= 13 are 0. The last iteration
    // keeps only "R != 0" (f_st) of its remainder.
    // ------------------------------------------------------------------
    localparam SW = 11;   // {sign, sp, er}

    wire          v_w    [0:NR];
    wire [25:0]   r_w    [0:NR-1];
    wire [24:0]   q_w    [0:NR];
    wire [25:0]   rad_w  [0:12];
    wire [SW-1:0] side_w [0:NR];
    wire          f_st;

    assign v_w[0]    = s2_v;
    assign r_w[0]    = 26'd0;
    assign q_w[0]    = 25'd0;
    assign rad_w[0]  = s2_rad;
    assign side_w[0] = {s2_sign, s2_sp, s2_er};

    genvar j;
    generate
        for (j = 0; j < NR; j = j + 1) begin : it
            wire [j:0]   r_in = r_w[j][j:0];
            // Q with one leading zero bit, so that iteration 0 has a width
            wire [j:0]   q_in = q_w[j][j:0];
            wire [1:0]   pair;
            if (j < 13) begin : rad_pair
                assign pair = rad_w[j][25:24];
            end else begin : zero_pair
                assign pair = 2'b00;
            end
            wire [j+2:0] rp   = {r_in, pair};            // 4R + pair
            wire [j+2:0] tt   = {q_in, 2'b01};           // 4Q + 1
            wire         bit_q;                          // rp >= tt
            // the new Q, j+1 bits (q_in[j] is the leading 0)
            wire [j:0]   qn;
            if (j == 0) begin : q_first
                assign qn = bit_q;
            end else begin : q_next
                assign qn = {q_in[j-1:0], bit_q};
            end

            reg          v_q;
            reg  [j:0]   q_q;
            reg  [SW-1:0] side_q;

            always @(posedge clk) begin
                if (rst)     v_q <= 1'b0;
                else if (ce) v_q <= v_w[j];
                if (ce) begin
                    q_q    <= qn;
                    side_q <= side_w[j];
                end
            end

            if (j < NR - 1) begin : rem
                // rp - tt lies in (-tt, 4Q + 2]: j+3 bits two's complement;
                // the new R, rp - tt or rp, is at most 2Q': j+2 bits
                wire [j+2:0] diff = rp - tt;
                reg  [j+1:0] r_q;
                assign bit_q = ~diff[j+2];
                // the select as AND/OR: where rp has constant-zero bits
                // (radicand pairs j >= 12) synthesis then feeds diff & bit
                // to the flip-flop's D, not to a synchronous reset (slower
                // setup on ECP5)
                always @(posedge clk)
                    if (ce) r_q <= (diff[j+1:0] & {(j+2){bit_q}}) | (rp[j+1:0] & {(j+2){~bit_q}});
                assign r_w[j+1] = {{(24-j){1'b0}}, r_q};
            end else begin : sticky
                // the new remainder is nonzero: rp != tt when the bit is
                // set (R = rp - tt), rp != 0 when it is not
                reg st_q;
                assign bit_q = (rp >= tt);
                always @(posedge clk)
                    if (ce) st_q <= bit_q ? (rp != tt) : (rp != {(j+3){1'b0}});
                assign f_st = st_q;
            end

            if (j < 12) begin : rad_shift
                reg [25:0] rad_q;
                always @(posedge clk)
                    if (ce) rad_q <= {rad_w[j][23:0], 2'b00};
                assign rad_w[j+1] = rad_q;
            end

            if (j < NR - 1) begin : zext
                assign q_w[j+1] = {{(NR-1-j){1'b0}}, q_q};
            end else begin : full
                assign q_w[j+1] = q_q;
            end

            assign v_w[j+1]    = v_q;
            assign side_w[j+1] = side_q;
        end
    endgenerate

    // ------------------------------------------------------------------
    // stage 3+NR: round to nearest even, specials
    // ------------------------------------------------------------------
    wire          f_v    = v_w[NR];
    wire [23:0]   f_q    = q_w[NR][23:0];    // bit 24, the hidden bit, is 1
    wire [SW-1:0] f_side = side_w[NR];
    wire          f_sign = f_side[10];
    wire [1:0]    f_sp   = f_side[9:8];
    wire [7:0]    f_er   = f_side[7:0];

    // f_q[0] is the round bit
    wire        inc = f_q[0] & (f_st | f_q[1]);
    wire [30:0] mag = {f_er, f_q[23:1]} + {30'd0, inc};

    reg        rn_v;
    reg [31:0] rn_y;

    always @(posedge clk) begin
        if (rst)     rn_v <= 1'b0;
        else if (ce) rn_v <= f_v;
        if (ce) begin
            case (f_sp)
                SP_NAN:  rn_y <= 32'h7FC0_0000;
                SP_INF:  rn_y <= 32'h7F80_0000;
                SP_ZERO: rn_y <= {f_sign, 31'd0};
                default: rn_y <= {1'b0, mag};
            endcase
        end
    end

    assign out_valid = rn_v;
    assign y         = rn_y;

endmodule

`default_nettype wire
