// l2l_fp32_add -- IEEE-754 binary32 addition/subtraction, y = a + b (a - b
// when sub = 1), round to nearest, ties to even; fully pipelined: one
// operation accepted on every clock-enabled cycle, result `L2L_FP32_ADD_LAT
// (7) ce-cycles later.
//
// Why: the EPS contract (docs/eps-numerics.md) makes every sum of the
// gradient reduction and of AdamW one binary32 addition rounded to nearest
// even, with subnormal inputs and results kept (no flush to zero), so the
// adder must give exactly the bits NumPy's float32 addition gives.
//
// How: a single-path adder with three extra bits below the significand
// (guard, round, sticky), which is enough for both effective addition and
// subtraction: when the exponents differ by 2 or more the difference needs at
// most a one-bit left normalisation, and when they differ by 0 or 1 nothing
// is shifted out, so the result is exact before rounding.
//   stage 1  compare |a| and |b| (31-bit magnitude compare), both exponent
//            differences (subnormals use exponent 1, no hidden bit);
//            classify NaN/inf
//   stage 2  swap so the big operand comes first, clamp the difference d; a
//            mask that marks the lowest position the normalisation may move
//            the leading one to without taking the exponent below 1 (this is
//            what makes subnormal results come out by themselves)
//   stage 3  align: the small significand shifted right by d, the bits
//            shifted out ORed into the sticky bit
//   stage 4  28-bit add or subtract
//   stage 5  leading-zero count of the sum ORed with the mask, so the count
//            never exceeds exponent - 1 (a two-level count); zero sum
//   stage 6  normalise: right by one on a carry-out, else left by the count
//   stage 7  round to nearest even by adding the increment to {exponent,
//            fraction} -- a carry out of the fraction bumps the exponent,
//            which turns the largest subnormal into the smallest normal and
//            the largest finite into infinity -- and select the special
//            results -> y
// Each stage holds one carry chain or a few LUT levels (fpga/rtl/
// timing_ecp5.py measures them; the leading-zero count is the longest).
//
// Special cases: any NaN operand, and inf - inf, give the canonical quiet NaN
// 0x7FC00000; inf + finite gives that inf; an exact zero sum is +0 except
// (-0) + (-0) = -0 (round to nearest); x - x = +0.
//
// Interface (fpga/rtl/README.md): (in_valid, a, b, sub) are sampled on a
// rising clk edge with ce = 1 and (out_valid, y) appear LAT ce-cycles later
// and hold while ce = 0. rst is synchronous, active high, acts whatever ce
// is, and clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_fp32_add (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [31:0] a,
    input  wire [31:0] b,
    input  wire        sub,
    output wire        out_valid,
    output wire [31:0] y
);

    localparam DEPTH = 7;   // the stages below

    initial begin
        if (DEPTH != `L2L_FP32_ADD_LAT) begin
            $error("l2l_fp32_add: pipeline depth %0d != L2L_FP32_ADD_LAT %0d",
                   DEPTH, `L2L_FP32_ADD_LAT);
            $finish;
        end
    end

    `include "l2l_lzc.vh"

    // ------------------------------------------------------------------
    // stage 1: classify, compare magnitudes, both exponent differences
    // ------------------------------------------------------------------
    wire        sb_eff  = b[31] ^ sub;              // sign of the effective addend
    wire        a_nan   = (a[30:23] == 8'hFF) && (a[22:0] != 23'd0);
    wire        b_nan   = (b[30:23] == 8'hFF) && (b[22:0] != 23'd0);
    wire        a_inf   = (a[30:23] == 8'hFF) && (a[22:0] == 23'd0);
    wire        b_inf   = (b[30:23] == 8'hFF) && (b[22:0] == 23'd0);
    wire        eff_sub = a[31] ^ sb_eff;
    wire        a_big   = (a[30:0] >= b[30:0]);      // magnitude order (not used for NaN)
    wire [7:0]  ea_1    = (a[30:23] == 8'd0) ? 8'd1 : a[30:23];   // subnormals: exponent 1
    wire [7:0]  eb_1    = (b[30:23] == 8'd0) ? 8'd1 : b[30:23];

    reg         s1_v;
    reg         s1_nan, s1_inf, s1_sa, s1_sb, s1_sub, s1_abig;
    reg  [30:0] s1_a, s1_b;
    reg  [7:0]  s1_ea, s1_eb, s1_dab, s1_dba;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_nan  <= a_nan | b_nan | (a_inf & b_inf & eff_sub);
            s1_inf  <= a_inf | b_inf;                // |big| is the inf
            s1_sa   <= a[31];
            s1_sb   <= sb_eff;
            s1_sub  <= eff_sub;
            s1_abig <= a_big;
            s1_a    <= a[30:0];
            s1_b    <= b[30:0];
            s1_ea   <= ea_1;
            s1_eb   <= eb_1;
            s1_dab  <= ea_1 - eb_1;
            s1_dba  <= eb_1 - ea_1;
        end
    end

    // ------------------------------------------------------------------
    // stage 2: swap so the big operand comes first, clamp the difference,
    // normalisation limit
    // ------------------------------------------------------------------
    wire [30:0] big     = s1_abig ? s1_a : s1_b;
    wire [30:0] sml     = s1_abig ? s1_b : s1_a;
    wire [7:0]  d       = s1_abig ? s1_dab : s1_dba;              // >= 0: |big| >= |small|
    wire [4:0]  d_clamp = (d > 8'd27) ? 5'd27 : d[4:0];
    wire [7:0]  big_e   = s1_abig ? s1_ea : s1_eb;
    // limit on the left normalisation shift: big_e - 1; a 1 placed at bit
    // 26 - (big_e - 1) = 27 - big_e of the count input stops the count there
    // (big_e >= 1; no 1 at all when big_e > 27: the shift is never limited)
    // bit 27 of the shift is never kept (big_e >= 1 moves the 1 below it)
    /* verilator lint_off UNUSEDSIGNAL */
    wire [27:0] lz_lim  = 28'h8000000 >> big_e;
    /* verilator lint_on UNUSEDSIGNAL */
    wire [26:0] lz_mask = lz_lim[26:0];

    reg         s2_v;
    reg         s2_nan, s2_inf, s2_sign, s2_sub;
    reg  [7:0]  s2_e;
    reg  [4:0]  s2_d;
    reg  [23:0] s2_mb, s2_ms;
    reg  [26:0] s2_mask;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_nan  <= s1_nan;
            s2_inf  <= s1_inf;
            s2_sign <= s1_abig ? s1_sa : s1_sb;
            s2_sub  <= s1_sub;
            s2_e    <= big_e;
            s2_d    <= d_clamp;
            s2_mb   <= {big[30:23] != 8'd0, big[22:0]};
            s2_ms   <= {sml[30:23] != 8'd0, sml[22:0]};
            s2_mask <= lz_mask;
        end
    end

    // ------------------------------------------------------------------
    // stage 3: align the small operand, sticky bit
    // ------------------------------------------------------------------
    wire [26:0] xs_full  = {s2_ms, 3'b000};
    wire [26:0] xs_shift = xs_full >> s2_d;
    wire        sticky   = |(xs_full & ~({27{1'b1}} << s2_d));

    reg         s3_v;
    reg         s3_nan, s3_inf, s3_sign, s3_sub;
    reg  [7:0]  s3_e;
    reg  [26:0] s3_xb, s3_xs, s3_mask;

    always @(posedge clk) begin
        if (rst)     s3_v <= 1'b0;
        else if (ce) s3_v <= s2_v;
        if (ce) begin
            s3_nan  <= s2_nan;
            s3_inf  <= s2_inf;
            s3_sign <= s2_sign;
            s3_sub  <= s2_sub;
            s3_e    <= s2_e;
            s3_xb   <= {s2_mb, 3'b000};
            s3_xs   <= {xs_shift[26:1], xs_shift[0] | sticky};
            s3_mask <= s2_mask;
        end
    end

    // ------------------------------------------------------------------
    // stage 4: add/subtract
    // ------------------------------------------------------------------
    wire [27:0] z = s3_sub ? ({1'b0, s3_xb} - {1'b0, s3_xs})
                           : ({1'b0, s3_xb} + {1'b0, s3_xs});

    reg         s4_v;
    reg         s4_nan, s4_inf, s4_sign, s4_sub;
    reg  [7:0]  s4_e;
    reg  [27:0] s4_z;
    reg  [26:0] s4_mask;

    always @(posedge clk) begin
        if (rst)     s4_v <= 1'b0;
        else if (ce) s4_v <= s3_v;
        if (ce) begin
            s4_nan  <= s3_nan;
            s4_inf  <= s3_inf;
            s4_sign <= s3_sign;
            s4_sub  <= s3_sub;
            s4_e    <= s3_e;
            s4_z    <= z;
            s4_mask <= s3_mask;
        end
    end

    // ------------------------------------------------------------------
    // stage 5: leading-zero count limited by the mask, zero sum
    // ------------------------------------------------------------------
    wire [31:0] lz_in  = {s4_z[26:0] | s4_mask, 5'b11111};  // padded: count <= 27
    // the padding bounds the count at 27: bit 5 (a count of 32) is never set
    /* verilator lint_off UNUSEDSIGNAL */
    wire [5:0]  lz_all = lzc32(lz_in);
    /* verilator lint_on UNUSEDSIGNAL */
    wire [4:0]  lz     = lz_all[4:0];

    reg         s5_v;
    reg         s5_nan, s5_inf, s5_sign, s5_zero;
    reg  [7:0]  s5_e;
    reg  [27:0] s5_z;
    reg  [4:0]  s5_lz;

    always @(posedge clk) begin
        if (rst)     s5_v <= 1'b0;
        else if (ce) s5_v <= s4_v;
        if (ce) begin
            s5_nan  <= s4_nan;
            s5_inf  <= s4_inf;
            // an exact zero sum: x - x = +0; (-0) + (-0) = -0 (the sign then
            // stands for the zero's sign, see stage 7)
            s5_sign <= (s4_z == 28'd0) ? (s4_sign & ~s4_sub) : s4_sign;
            s5_zero <= (s4_z == 28'd0);
            s5_e    <= s4_e;
            s5_z    <= s4_z;
            s5_lz   <= lz;
        end
    end

    // ------------------------------------------------------------------
    // stage 6: normalise (right by one on a carry-out, else left by the count)
    // ------------------------------------------------------------------
    wire        carry = s5_z[27];
    wire [26:0] n     = carry ? {s5_z[27:2], s5_z[1] | s5_z[0]} : (s5_z[26:0] << s5_lz);
    wire [8:0]  e     = carry ? ({1'b0, s5_e} + 9'd1) : ({1'b0, s5_e} - {4'd0, s5_lz});

    reg         s6_v;
    reg         s6_nan, s6_inf, s6_sign, s6_zero;
    reg  [8:0]  s6_e;
    reg  [26:0] s6_n;

    always @(posedge clk) begin
        if (rst)     s6_v <= 1'b0;
        else if (ce) s6_v <= s5_v;
        if (ce) begin
            s6_nan  <= s5_nan;
            s6_inf  <= s5_inf;
            s6_sign <= s5_sign;
            s6_zero <= s5_zero;
            s6_e    <= e;
            s6_n    <= n;
        end
    end

    // ------------------------------------------------------------------
    // stage 7: round to nearest even, pack, special cases
    // ------------------------------------------------------------------
    wire        inc = s6_n[2] & (s6_n[1] | s6_n[0] | s6_n[3]);
    wire [7:0]  ef  = s6_n[26] ? s6_e[7:0] : 8'd0;  // leading bit clear: subnormal (e = 1)
    wire [30:0] mag = {ef, s6_n[25:3]} + {30'd0, inc};
    wire        ovf = (s6_e >= 9'd255);             // only after a carry-out

    reg         s7_v;
    reg  [31:0] s7_y;

    always @(posedge clk) begin
        if (rst)     s7_v <= 1'b0;
        else if (ce) s7_v <= s6_v;
        if (ce) begin
            if (s6_nan)
                s7_y <= 32'h7FC00000;
            else if (s6_inf | ovf)
                s7_y <= {s6_sign, 8'hFF, 23'd0};
            else if (s6_zero)
                s7_y <= {s6_sign, 31'd0};
            else
                s7_y <= {s6_sign, mag};
        end
    end

    assign out_valid = s7_v;
    assign y         = s7_y;

endmodule

`default_nettype wire
