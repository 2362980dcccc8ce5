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
//   1       classify both operands (zero/subnormal/inf/NaN), leading zeros
//   2       normalise the significands, biased quotient exponent
//   3       integer quotient bit and pre-scale (ma >= mb ? ma - mb : 2ma - mb)
//   4..27   24 quotient bits (23 fraction + round), one per stage
//   28      subnormal right shift with sticky collection
//   29      round to nearest even, overflow, special cases -> y
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
    // stage 1: classify, leading zeros
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
    reg [7:0]  s1_ea, s1_eb;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_sign <= a[31] ^ b[31];
            s1_sp   <= is_nan ? SP_NAN : is_inf ? SP_INF : is_zero ? SP_ZERO : SP_NONE;
            s1_ma   <= ma0;
            s1_mb   <= mb0;
            s1_lza  <= lzc24(ma0);
            s1_lzb  <= lzc24(mb0);
            // a subnormal has the exponent of the smallest normal
            s1_ea   <= (ea == 8'd0) ? 8'd1 : ea;
            s1_eb   <= (eb == 8'd0) ? 8'd1 : eb;
        end
    end

    // ------------------------------------------------------------------
    // stage 2: normalise, quotient exponent (biased, 10-bit signed:
    // (ea - lza) - (eb - lzb) + 127 lies in [-149, 403])
    // ------------------------------------------------------------------
    reg        s2_v;
    reg        s2_sign;
    reg [1:0]  s2_sp;
    reg [23:0] s2_ma, s2_mb;
    reg [9:0]  s2_e;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_sign <= s1_sign;
            s2_sp   <= s1_sp;
            s2_ma   <= s1_ma << s1_lza;
            s2_mb   <= s1_mb << s1_lzb;
            s2_e    <= {2'b00, s1_ea} - {5'd0, s1_lza} - {2'b00, s1_eb} + {5'd0, s1_lzb} + 10'd127;
        end
    end

    // ------------------------------------------------------------------
    // stage 3: integer quotient bit (always 1 after pre-scaling)
    // ------------------------------------------------------------------
    wire [24:0] d_ge = {1'b0, s2_ma} - {1'b0, s2_mb};   // ma - mb
    wire [24:0] d_lt = {s2_ma, 1'b0} - {1'b0, s2_mb};   // 2ma - mb, used when ma < mb
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
            s3_rem  <= ge ? d_ge[23:0] : d_lt[23:0];
            s3_d    <= s2_mb;
            s3_e    <= ge ? s2_e : s2_e - 10'd1;
        end
    end

    // ------------------------------------------------------------------
    // stages 4 .. 3+NIT: one quotient bit each. Element k of each array is
    // the state after iteration k (element 0: stage 3). The quotient after
    // iteration k has k+1 bits.
    // side info after iteration 1: {sign, sp, sub, sh, ovf, ef} =
    // 1 + 2 + 1 + 5 + 1 + 8 bits
    // ------------------------------------------------------------------
    localparam SW = 18;

    wire          v_w    [0:NIT];
    wire [23:0]   rem_w  [0:NIT];
    wire [23:0]   d_w    [0:NIT];
    wire [24:0]   q_w    [0:NIT];
    wire [SW-1:0] side_w [0:NIT];

    assign v_w[0]    = s3_v;
    assign rem_w[0]  = s3_rem;
    assign d_w[0]    = s3_d;
    assign q_w[0]    = 25'd1;
    assign side_w[0] = {s3_sign, s3_sp, 15'd0};

    genvar k;
    generate
        for (k = 1; k <= NIT; k = k + 1) begin : it
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
                    rem_q <= bit_q ? t[23:0] : {rem_in[22:0], 1'b0};
                    d_q   <= d_in;
                    q_q   <= {q_in, bit_q};
                end
            end

            if (k == 1) begin : exp_side
                // the exponent is final: decide subnormal shift and overflow
                wire [9:0] e_in  = s3_e;
                wire       sub   = e_in[9] | (e_in == 10'd0);        // e <= 0
                wire [9:0] sh_w  = 10'd1 - e_in;                     // 1 - e
                wire [4:0] sh    = (sh_w > 10'd31) ? 5'd31 : sh_w[4:0];
                wire       ovf   = ~e_in[9] & (e_in >= 10'd255);
                wire [SW-1:0] side_in = side_w[0];
                always @(posedge clk)
                    if (ce) side_q <= {side_in[SW-1:SW-3], sub, sh, ovf, e_in[7:0]};
            end else begin : pass_side
                always @(posedge clk)
                    if (ce) side_q <= side_w[k-1];
            end

            assign v_w[k]    = v_q;
            assign rem_w[k]  = rem_q;
            assign d_w[k]    = d_q;
            assign q_w[k]    = q_q;           // zero-extended
            assign side_w[k] = side_q;
        end
    endgenerate

    // ------------------------------------------------------------------
    // stage 4+NIT: subnormal shift. x = {1.23 significand, round, sticky}
    // ------------------------------------------------------------------
    wire          f_v    = v_w[NIT];
    wire [23:0]   f_rem  = rem_w[NIT];
    wire [24:0]   f_q    = q_w[NIT];
    wire [SW-1:0] f_side = side_w[NIT];
    wire          f_sign = f_side[17];
    wire [1:0]    f_sp   = f_side[16:15];
    wire          f_sub  = f_side[14];
    wire [4:0]    f_sh   = f_side[13:9];
    wire          f_ovf  = f_side[8];
    wire [7:0]    f_ef   = f_side[7:0];

    wire [25:0] x      = {f_q, f_rem != 24'd0};
    wire [25:0] xs     = x >> f_sh;
    wire [31:0] lost_m = ~(32'hFFFF_FFFF << f_sh);
    wire        lost   = (x & lost_m[25:0]) != 26'd0;

    reg        sf_v;
    reg        sf_sign;
    reg [1:0]  sf_sp;
    reg        sf_ovf;
    reg [7:0]  sf_ef;
    reg [22:0] sf_frac;
    reg        sf_lsb, sf_rb, sf_st;

    always @(posedge clk) begin
        if (rst)     sf_v <= 1'b0;
        else if (ce) sf_v <= f_v;
        if (ce) begin
            sf_sign <= f_sign;
            sf_sp   <= f_sp;
            sf_ovf  <= f_ovf;
            if (f_sub) begin
                // xs[25] is 0 (shift >= 1): no hidden bit, exponent field 0
                sf_ef   <= 8'd0;
                sf_frac <= xs[24:2];
                sf_lsb  <= xs[2];
                sf_rb   <= xs[1];
                sf_st   <= xs[0] | lost;
            end else begin
                sf_ef   <= f_ef;
                sf_frac <= x[24:2];
                sf_lsb  <= x[2];
                sf_rb   <= x[1];
                sf_st   <= x[0];
            end
        end
    end

    // ------------------------------------------------------------------
    // stage 5+NIT: round to nearest even, specials
    // ------------------------------------------------------------------
    wire        inc = sf_rb & (sf_st | sf_lsb);
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
