// l2l_fp32_div -- IEEE-754 binary32 division y = a / b, correctly rounded
// (round to nearest, ties to even), fully pipelined: one operation accepted on
// every clock-enabled cycle, result after `L2L_FP32_DIV_LAT cycles.
//
// Why: the EPS AdamW step divides m' by d = sqrt(v')*inv_bc2_sqrt + eps once
// per element, so the divider must take a new operand pair every clock and
// give exactly the bits NumPy's float32 division gives (the numerical contract
// allows no reciprocal approximation and no flush to zero).
//
// How: subnormal operands are normalised (leading-zero count, then shift);
// the 24-bit significands are divided by an unrolled radix-2 restoring digit
// recurrence, one quotient bit and one 25-bit subtraction per stage. The first
// stage pre-scales the dividend so the quotient lies in [1, 2) (exponent - 1
// when ma < mb); 24 more stages produce 23 fraction bits and the round bit;
// the final remainder is the sticky bit. A quotient below the normal range is
// shifted right by 1 - e before rounding, the shifted-out bits joining the
// sticky bit, so the rounding position moves with it. Rounding adds the
// round-up increment to {exponent, fraction}: a carry out of the fraction
// bumps the exponent, so a subnormal that rounds up to 2^-126 comes out as
// the smallest normal with no extra logic. (For a quotient of 24-bit
// significands that carry into 2^-126 happens only at the exact tie
// (2^24 - 1) * 2^-150, and in the normal range a quotient never rounds up
// across a power of two, so overflow is decided by the exponent alone.)
//
// Stages (each registered, all advanced by ce):
//   1       classify both operands (zero/subnormal/inf/NaN), leading zeros,
//           whole-byte part of the normalising shift, exponent difference
//           ea - eb + 127 (and + 126)
//   2       rest of the normalising shift (0..7 bits), biased quotient
//           exponent e and e - 1
//   3       integer quotient bit and pre-scale (ma >= mb ? ma - mb : 2ma - mb),
//           exponent select
//   4..27   24 quotient bits (23 fraction + round), one per stage; stage 4
//           also decodes the exponent (subnormal shift, overflow), stage 27
//           (round bit) also makes the sticky bit so far and shifts right
//           by the whole-byte part of the subnormal shift
//   28      rest of the subnormal right shift (0..7 bits), sticky bit
//   29      round to nearest even, overflow, special cases -> y
//
// Timing (yosys synth_ecp5, nextpnr-ecp5 --85k, out of context): every
// stage is one carry chain of at most 31 bits plus a LUT level or two, or a
// few LUT levels with no carry chain; no stage chains two carry chains or a
// carry chain into a wide OR. The slowest stages are the rounding
// increment, the round-bit stage and a quotient-bit iteration (25-bit
// subtract, then select): 173-190 MHz over nextpnr seeds 1-3, where a
// registered 32-bit adder reaches ~277 MHz.
//
// Special cases: NaN in, 0/0, inf/inf give the canonical quiet NaN
// 0x7FC00000; x/0 (x != 0) and inf/finite give signed infinity; 0/x and
// finite/inf give signed zero.
//
// Interface and latency: fpga/rtl/README.md, l2l_fp_latency.vh. rst is
// synchronous and clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_fp32_div (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [31:0] a,
    input  wire [31:0] b,
    output wire        out_valid,
    output wire [31:0] y
);

    // quotient bits produced after the integer bit (23 fraction + 1 round)
    localparam NIT   = 24;
    // pipeline depth: classify, normalise, first bit, NIT bits, shift, round
    localparam DEPTH = 3 + NIT + 2;

    localparam [1:0] SP_NONE = 2'd0, SP_ZERO = 2'd1, SP_INF = 2'd2, SP_NAN = 2'd3;

    initial begin
        if (DEPTH != `L2L_FP32_DIV_LAT) begin
            $error("l2l_fp32_div: pipeline depth %0d != L2L_FP32_DIV_LAT %0d",
                   DEPTH, `L2L_FP32_DIV_LAT);
            $finish;
        end
    end

    `include "l2l_lzc.vh"

    // ------------------------------------------------------------------
    // stage 1: classify, leading zeros, whole-byte part of the normalising
    // shift
    // ------------------------------------------------------------------
    wire [7:0]  ea = a[30:23];
    wire [7:0]  eb = b[30:23];
    wire [22:0] fa = a[22:0];
    wire [22:0] fb = b[22:0];
    wire a_emax = (ea == 8'hFF);
    wire b_emax = (eb == 8'hFF);
    wire a_fz   = (fa == 23'd0);
    wire b_fz   = (fb == 23'd0);
    wire a_nan  = a_emax & ~a_fz;
    wire b_nan  = b_emax & ~b_fz;
    wire a_inf  = a_emax & a_fz;
    wire b_inf  = b_emax & b_fz;
    wire a_zero = (ea == 8'd0) & a_fz;
    wire b_zero = (eb == 8'd0) & b_fz;
    wire is_nan  = a_nan | b_nan | (a_inf & b_inf) | (a_zero & b_zero);
    wire is_inf  = ~is_nan & (a_inf | b_zero);
    wire is_zero = ~is_nan & (a_zero | b_inf);
    wire [23:0] ma0 = {ea != 8'd0, fa};
    wire [23:0] mb0 = {eb != 8'd0, fb};

    reg        s1_v;
    reg        s1_sign;
    reg [1:0]  s1_sp;
    reg [23:0] s1_ma, s1_mb;
    reg [4:0]  s1_lza, s1_lzb;
    reg [9:0]  s1_ed0, s1_ed1;

    // a subnormal has the exponent of the smallest normal
    wire [9:0] ea10 = {2'b00, ea[7:1], ea[0] | (ea == 8'd0)};
    wire [9:0] eb10 = {2'b00, eb[7:1], eb[0] | (eb == 8'd0)};

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_sign <= a[31] ^ b[31];
            s1_sp   <= is_nan ? SP_NAN : is_inf ? SP_INF : is_zero ? SP_ZERO : SP_NONE;
            s1_ma   <= byte_norm(ma0);
            s1_mb   <= byte_norm(mb0);
            s1_lza  <= lzc24(ma0);
            s1_lzb  <= lzc24(mb0);
            // quotient exponent before normalisation, and one less
            s1_ed0  <= ea10 - eb10 + 10'd127;
            s1_ed1  <= ea10 - eb10 + 10'd126;
        end
    end

    // ------------------------------------------------------------------
    // stage 2: normalise (the shift by lz[2:0] left after stage 1's whole
    // bytes), quotient exponent (biased, 10-bit signed:
    // (ea - lza) - (eb - lzb) + 127 lies in [-149, 403]) and one less, for
    // stage 3 to pick without an adder after its compare
    // ------------------------------------------------------------------
    // lzb - lza in [-23, 23], sign-extended to 10 bits
    wire [5:0] dlz  = {1'b0, s1_lzb} - {1'b0, s1_lza};

    reg        s2_v;
    reg        s2_sign;
    reg [1:0]  s2_sp;
    reg [23:0] s2_ma, s2_mb;
    reg [9:0]  s2_e, s2_em1;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_sign <= s1_sign;
            s2_sp   <= s1_sp;
            s2_ma   <= s1_ma << s1_lza[2:0];
            s2_mb   <= s1_mb << s1_lzb[2:0];
            s2_e    <= s1_ed0 + {{4{dlz[5]}}, dlz};
            s2_em1  <= s1_ed1 + {{4{dlz[5]}}, dlz};
        end
    end

    // ------------------------------------------------------------------
    // stage 3: integer quotient bit (always 1 after pre-scaling)
    // ------------------------------------------------------------------
    wire [24:0] d_ge = {1'b0, s2_ma} - {1'b0, s2_mb};   // ma - mb
    // 2ma - mb, used when ma < mb: then it lies in (0, mb), so 24 bits of
    // modulo-2^24 arithmetic hold it
    wire [23:0] d_lt = {s2_ma[22:0], 1'b0} - s2_mb;
    wire        ge   = ~d_ge[24];

    reg        s3_v;
    reg        s3_sign;
    reg [1:0]  s3_sp;
    reg [23:0] s3_rem, s3_d;
    reg [9:0]  s3_e;

    always @(posedge clk) begin
        if (rst)     s3_v <= 1'b0;
        else if (ce) s3_v <= s2_v;
        if (ce) begin
            s3_sign <= s2_sign;
            s3_sp   <= s2_sp;
            s3_rem  <= ge ? d_ge[23:0] : d_lt;
            s3_d    <= s2_mb;
            s3_e    <= ge ? s2_e : s2_em1;
        end
    end

    // ------------------------------------------------------------------
    // stages 4 .. 2+NIT: one quotient bit each. Element k of each array is
    // the state after iteration k (element 0: stage 3). The quotient after
    // iteration k has k+1 bits (the array holds it zero-extended).
    // side info after iteration 1: {sign, sp, sh, ovf, ef} =
    // 1 + 2 + 5 + 1 + 8 bits
    // ------------------------------------------------------------------
    localparam SW = 17;

    wire          v_w    [0:NIT-1];
    wire [23:0]   rem_w  [0:NIT-1];
    wire [23:0]   d_w    [0:NIT-1];
    wire [23:0]   q_w    [0:NIT-1];
    wire [SW-1:0] side_w [0:NIT-1];

    assign v_w[0]    = s3_v;
    assign rem_w[0]  = s3_rem;
    assign d_w[0]    = s3_d;
    assign q_w[0]    = 24'd1;
    assign side_w[0] = {s3_sign, s3_sp, 14'd0};

    genvar k;
    generate
        for (k = 1; k < NIT; k = k + 1) begin : it
            wire [23:0] rem_in = rem_w[k-1];
            wire [23:0] d_in   = d_w[k-1];
            wire [k-1:0] q_in  = q_w[k-1][k-1:0];
            // 2*rem - d lies in (-d, d): 25-bit two's complement
            wire [24:0] t      = {rem_in, 1'b0} - {1'b0, d_in};
            wire        bit_q  = ~t[24];

            reg         v_q;
            reg  [23:0] rem_q;
            reg  [23:0] d_q;
            reg  [k:0]  q_q;
            reg  [SW-1:0] side_q;

            always @(posedge clk) begin
                if (rst)     v_q <= 1'b0;
                else if (ce) v_q <= v_w[k-1];
                if (ce) begin
                    // bit 0 is t[0] or 0 (2rem is even), written as an AND
                    // so that synthesis feeds it to the flip-flop's D rather
                    // than to a synchronous reset (slower setup on ECP5)
                    rem_q <= {bit_q ? t[23:1] : rem_in[22:0], bit_q & t[0]};
                    d_q   <= d_in;
                    q_q   <= {q_in, bit_q};
                end
            end

            if (k == 1) begin : exp_side
                // The exponent is final: decide subnormal shift and overflow,
                // each in LUTs beside (not after) a short carry chain.
                // e <= 0: subnormal, the shift is 1 - e, saturated at 31
                // (any shift >= 26 drops every bit) when e <= -31, i.e.
                // unless e[9:5] is all ones with e[4:0] >= 2; 1 - e <= 31 is
                // exact in 5 bits. A normal quotient shifts by 0, so that
                // the shift stages have no normal/subnormal select; its
                // exponent field is e, a subnormal's is 0.
                // e >= 255: overflow (e <= 403 < 512).
                wire [9:0] e_in = s3_e;
                wire       sub  = e_in[9] | (e_in == 10'd0);
                wire       sat  = e_in[9] & ~(&e_in[8:5] & (|e_in[4:1]));
                wire [4:0] sh5  = 5'd1 - e_in[4:0];
                wire [4:0] sh   = ~sub ? 5'd0 : sat ? 5'd31 : sh5;
                wire [7:0] ef   = sub ? 8'd0 : e_in[7:0];
                wire       ovf  = ~e_in[9] & (e_in[8] | (&e_in[7:0]));
                wire [2:0] side_in = side_w[0][SW-1:SW-3];
                always @(posedge clk)
                    if (ce) side_q <= {side_in, sh, ovf, ef};
            end else begin : pass_side
                always @(posedge clk)
                    if (ce) side_q <= side_w[k-1];
            end

            if (k < NIT - 1) begin : zext
                assign q_w[k] = {{(NIT-1-k){1'b0}}, q_q};
            end else begin : full
                assign q_w[k] = q_q;
            end

            assign v_w[k]    = v_q;
            assign rem_w[k]  = rem_q;
            assign d_w[k]    = d_q;
            assign side_w[k] = side_q;
        end
    endgenerate

    // ------------------------------------------------------------------
    // stage 3+NIT: the round bit (last iteration), whole-byte part of the
    // subnormal shift, sticky bit so far. With x = {q, round, 0} (26 bits:
    // hidden bit, 23 fraction bits, round bit, 0) and the shift
    // sh = 8c + f, this stage forms xc = x >> 8c and the OR of the bits
    // that drops, joined with "remainder != 0"; stage 4+NIT shifts xc by f.
    // The round bit, which arrives from the carry chain, only lands in xc
    // (c = 0) or in the sticky bit (c > 0); every other term is ready
    // beside the subtraction, and the sticky bit is kept as its two
    // candidates (round bit 1 / 0) for stage 4+NIT to pick. The remainder is nonzero when
    // 2rem != d (round bit 1: rem' = 2rem - d) or rem != 0 (round bit 0:
    // rem' = 2rem), compares with no carry chain.
    // ------------------------------------------------------------------
    wire [23:0]   l_rem  = rem_w[NIT-1];
    wire [23:0]   l_d    = d_w[NIT-1];
    wire [23:0]   l_q    = q_w[NIT-1];      // hidden bit, 23 fraction bits
    wire [SW-1:0] l_side = side_w[NIT-1];
    wire [1:0]    l_c    = l_side[13:12];   // sh[4:3]
    wire [2:0]    l_f    = l_side[11:9];    // sh[2:0]

    wire        l_round = ({l_rem, 1'b0} >= {1'b0, l_d});   // 2rem >= d
    wire        l_ne    = ({l_rem, 1'b0} != {1'b0, l_d});
    wire        l_rnz   = (l_rem != 24'd0);

    // {q, 0, 0} >> 8c for c > 0 (the round bit is shifted out), and the
    // OR of the q bits that drops: x[8c-1:2] = l_q[8c-3:0]
    reg  [25:0] l_xq;
    reg         l_qor;
    always @* begin
        case (l_c)
            2'd1:    begin l_xq = {8'd0,  l_q[23:6]};  l_qor = |l_q[5:0];  end
            2'd2:    begin l_xq = {16'd0, l_q[23:14]}; l_qor = |l_q[13:0]; end
            2'd3:    begin l_xq = {24'd0, l_q[23:22]}; l_qor = |l_q[21:0]; end
            default: begin l_xq = {l_q, 2'b00};        l_qor = 1'b0;       end
        endcase
    end

    // the sticky bit so far (remainder, dropped q bits, dropped round
    // bit) for a round bit of 1 and for one of 0
    wire        st_if1  = l_ne | l_qor | (l_c != 2'd0);
    wire        st_if0  = l_rnz | l_qor;

    reg           xc_v;
    reg  [25:0]   xc_x;
    reg           xc_rnd;   // the round bit
    reg           xc_s1;    // sticky bit so far if xc_rnd, and if not
    reg           xc_s0;
    reg  [7:0]    xc_m;     // xc_m[i] = (i <= f): the bits xc[f:0]
    reg  [14:0]   xc_side;  // {sign, sp, f, ovf, ef}

    always @(posedge clk) begin
        if (rst)     xc_v <= 1'b0;
        else if (ce) xc_v <= v_w[NIT-1];
        if (ce) begin
            xc_x    <= (l_c == 2'd0) ? {l_q, l_round, 1'b0} : l_xq;
            // the select on the round bit is left to stage 4+NIT, so that
            // the carry chain's output meets no logic here but xc_x[1]'s
            xc_rnd  <= l_round;
            xc_s1   <= st_if1;
            xc_s0   <= st_if0;
            xc_m    <= ~(8'hFE << l_f);
            xc_side <= {l_side[16:14], l_f, l_side[8:0]};
        end
    end

    // ------------------------------------------------------------------
    // stage 4+NIT: rest of the subnormal shift (by f; 0 for a normal
    // quotient); the bits xc[f-1:0] it drops and xs[0] = xc[f] join the
    // sticky bit
    // ------------------------------------------------------------------
    wire          f_sign = xc_side[14];
    wire [1:0]    f_sp   = xc_side[13:12];
    wire [2:0]    f_f    = xc_side[11:9];
    wire          f_ovf  = xc_side[8];
    wire [7:0]    f_ef   = xc_side[7:0];

    // xs[25] is the hidden bit of a normal quotient (shift 0), implied by
    // its exponent field; a subnormal's is 0: not read
    /* verilator lint_off UNUSEDSIGNAL */
    wire [25:0] xs     = xc_x >> f_f;
    /* verilator lint_on UNUSEDSIGNAL */
    wire        lost   = (xc_x[7:0] & xc_m) != 8'd0;

    reg        sf_v;
    reg        sf_sign;
    reg [1:0]  sf_sp;
    reg        sf_ovf;
    reg [7:0]  sf_ef;
    reg [22:0] sf_frac;
    reg        sf_rb, sf_st;

    always @(posedge clk) begin
        if (rst)     sf_v <= 1'b0;
        else if (ce) sf_v <= xc_v;
        if (ce) begin
            sf_sign <= f_sign;
            sf_sp   <= f_sp;
            sf_ovf  <= f_ovf;
            sf_ef   <= f_ef;
            sf_frac <= xs[24:2];
            sf_rb   <= xs[1];
            sf_st   <= lost | (xc_rnd ? xc_s1 : xc_s0);
        end
    end

    // ------------------------------------------------------------------
    // stage 5+NIT: round to nearest even, specials
    // ------------------------------------------------------------------
    wire        inc = sf_rb & (sf_st | sf_frac[0]);
    wire [30:0] mag = {sf_ef, sf_frac} + {30'd0, inc};

    reg        rn_v;
    reg [31:0] rn_y;

    always @(posedge clk) begin
        if (rst)     rn_v <= 1'b0;
        else if (ce) rn_v <= sf_v;
        if (ce) begin
            case (sf_sp)
                SP_NAN:  rn_y <= 32'h7FC0_0000;
                SP_INF:  rn_y <= {sf_sign, 8'hFF, 23'd0};
                SP_ZERO: rn_y <= {sf_sign, 31'd0};
                default: rn_y <= sf_ovf ? {sf_sign, 8'hFF, 23'd0} : {sf_sign, mag};
            endcase
        end
    end

    assign out_valid = rn_v;
    assign y         = rn_y;

endmodule

`default_nettype wire
