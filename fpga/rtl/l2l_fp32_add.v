// l2l_fp32_add -- IEEE-754 binary32 addition/subtraction, y = a + b (a - b
// when sub = 1), round to nearest, ties to even; fully pipelined: one
// operation accepted on every clock-enabled cycle, result `L2L_FP32_ADD_LAT
// (4) ce-cycles later.
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
//   stage 1  compare |a| and |b| (31-bit magnitude compare), swap so the big
//            operand comes first, exponent difference d (subnormals use
//            exponent 1, no hidden bit); classify NaN/inf; a mask that marks
//            the lowest position the normalisation may move the leading one
//            to without taking the exponent below 1 (this is what makes
//            subnormal results come out by themselves)
//   stage 2  align: the small significand shifted right by d, the bits
//            shifted out ORed into the sticky bit
//   stage 3  28-bit add or subtract; leading-zero count of the sum ORed with
//            the stage-1 mask, so the count never exceeds exponent - 1 (a
//            five-level tree count)
//   stage 4  normalise (right by one on a carry-out, else left by the count),
//            round to nearest even by adding the increment to
//            {exponent, fraction} -- a carry out of the fraction bumps the
//            exponent, which turns the largest subnormal into the smallest
//            normal and the largest finite into infinity -- and select the
//            special results -> y
// Stage 4 (a 27-bit shifter, the rounding carry chain and a 4:1 result
// select) is the longest path; for timing closure above ~300 MHz on an
// UltraScale+ split it (shift | round) and raise L2L_FP32_ADD_LAT.
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

    localparam DEPTH = 4;   // the stages below

    initial begin
        if (DEPTH != `L2L_FP32_ADD_LAT) begin
            $error("l2l_fp32_add: pipeline depth %0d != L2L_FP32_ADD_LAT %0d",
                   DEPTH, `L2L_FP32_ADD_LAT);
            $finish;
        end
    end

    `include "l2l_lzc.vh"

    // ------------------------------------------------------------------
    // stage 1: classify, compare magnitudes, swap, exponent difference
    // ------------------------------------------------------------------
    wire        sb_eff  = b[31] ^ sub;              // sign of the effective addend
    wire        a_nan   = (a[30:23] == 8'hFF) && (a[22:0] != 23'd0);
    wire        b_nan   = (b[30:23] == 8'hFF) && (b[22:0] != 23'd0);
    wire        a_inf   = (a[30:23] == 8'hFF) && (a[22:0] == 23'd0);
    wire        b_inf   = (b[30:23] == 8'hFF) && (b[22:0] == 23'd0);
    wire        eff_sub = a[31] ^ sb_eff;
    wire        a_big   = (a[30:0] >= b[30:0]);      // magnitude order (not used for NaN)

    wire [30:0] big     = a_big ? a[30:0] : b[30:0];
    wire [30:0] sml     = a_big ? b[30:0] : a[30:0];
    wire        big_s   = a_big ? a[31] : sb_eff;
    // exponent difference: both orders computed next to the compare, then selected
    wire [7:0]  ea_1    = (a[30:23] == 8'd0) ? 8'd1 : a[30:23];   // subnormals: exponent 1
    wire [7:0]  eb_1    = (b[30:23] == 8'd0) ? 8'd1 : b[30:23];
    wire [7:0]  d_ab    = ea_1 - eb_1;
    wire [7:0]  d_ba    = eb_1 - ea_1;
    wire [4:0]  dc_ab   = (d_ab > 8'd27) ? 5'd27 : d_ab[4:0];
    wire [4:0]  dc_ba   = (d_ba > 8'd27) ? 5'd27 : d_ba[4:0];
    wire [4:0]  d_clamp = a_big ? dc_ab : dc_ba;                  // >= 0: |big| >= |small|
    wire [7:0]  big_e   = a_big ? ea_1 : eb_1;
    // limit on the left normalisation shift: big_e - 1; a 1 placed at bit
    // 26 - (big_e - 1) of the count input stops the count there
    wire [7:0]  lim     = big_e - 8'd1;
    wire [26:0] lz_mask = (lim > 8'd26) ? 27'd0 : (27'h4000000 >> lim[4:0]);

    reg         s1_v;
    reg         s1_nan, s1_inf, s1_sign, s1_sub;
    reg  [7:0]  s1_e;
    reg  [4:0]  s1_d;
    reg  [23:0] s1_mb, s1_ms;
    reg  [26:0] s1_mask;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_nan  <= a_nan | b_nan | (a_inf & b_inf & eff_sub);
            s1_inf  <= a_inf | b_inf;                // |big| is the inf
            s1_sign <= big_s;
            s1_sub  <= eff_sub;
            s1_e    <= big_e;
            s1_d    <= d_clamp;
            s1_mb   <= {big[30:23] != 8'd0, big[22:0]};
            s1_ms   <= {sml[30:23] != 8'd0, sml[22:0]};
            s1_mask <= lz_mask;
        end
    end

    // ------------------------------------------------------------------
    // stage 2: align the small operand, sticky bit
    // ------------------------------------------------------------------
    wire [26:0] xs_full  = {s1_ms, 3'b000};
    wire [26:0] xs_shift = xs_full >> s1_d;
    wire        sticky   = |(xs_full & ~({27{1'b1}} << s1_d));

    reg         s2_v;
    reg         s2_nan, s2_inf, s2_sign, s2_sub;
    reg  [7:0]  s2_e;
    reg  [26:0] s2_xb, s2_xs, s2_mask;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_nan  <= s1_nan;
            s2_inf  <= s1_inf;
            s2_sign <= s1_sign;
            s2_sub  <= s1_sub;
            s2_e    <= s1_e;
            s2_xb   <= {s1_mb, 3'b000};
            s2_xs   <= {xs_shift[26:1], xs_shift[0] | sticky};
            s2_mask <= s1_mask;
        end
    end

    // ------------------------------------------------------------------
    // stage 3: add/subtract, limited leading-zero count
    // ------------------------------------------------------------------
    wire [27:0] z = s2_sub ? ({1'b0, s2_xb} - {1'b0, s2_xs})
                           : ({1'b0, s2_xb} + {1'b0, s2_xs});

    wire [31:0] lz_in  = {z[26:0] | s2_mask, 5'b11111};     // padded: count <= 27
    wire [5:0]  lz_all = lzc32(lz_in);
    wire [4:0]  lz     = lz_all[4:0];                    // <= 27

    reg         s3_v;
    reg         s3_nan, s3_inf, s3_sign, s3_sub;
    reg  [7:0]  s3_e;
    reg  [27:0] s3_z;
    reg  [4:0]  s3_lz;

    always @(posedge clk) begin
        if (rst)     s3_v <= 1'b0;
        else if (ce) s3_v <= s2_v;
        if (ce) begin
            s3_nan  <= s2_nan;
            s3_inf  <= s2_inf;
            s3_sign <= s2_sign;
            s3_sub  <= s2_sub;
            s3_e    <= s2_e;
            s3_z    <= z;
            s3_lz   <= lz;
        end
    end

    // ------------------------------------------------------------------
    // stage 4: normalise, round to nearest even, pack, special cases
    // ------------------------------------------------------------------
    wire        carry = s3_z[27];
    wire        zero  = (s3_z == 28'd0);
    wire [26:0] n     = carry ? {s3_z[27:2], s3_z[1] | s3_z[0]} : (s3_z[26:0] << s3_lz);
    wire [8:0]  e     = carry ? ({1'b0, s3_e} + 9'd1) : ({1'b0, s3_e} - {4'd0, s3_lz});
    wire        inc   = n[2] & (n[1] | n[0] | n[3]);
    wire [7:0]  ef    = n[26] ? e[7:0] : 8'd0;       // leading bit clear: subnormal (e = 1)
    wire [30:0] mag   = {ef, n[25:3]} + {30'd0, inc};
    wire        ovf   = (e >= 9'd255);               // only after a carry-out

    reg         s4_v;
    reg  [31:0] s4_y;

    always @(posedge clk) begin
        if (rst)     s4_v <= 1'b0;
        else if (ce) s4_v <= s3_v;
        if (ce) begin
            if (s3_nan)
                s4_y <= 32'h7FC00000;
            else if (s3_inf | ovf)
                s4_y <= {s3_sign, 8'hFF, 23'd0};
            else if (zero)
                s4_y <= {s3_sign & ~s3_sub, 31'd0};  // x - x = +0; (-0) + (-0) = -0
            else
                s4_y <= {s3_sign, mag};
        end
    end

    assign out_valid = s4_v;
    assign y         = s4_y;

endmodule

`default_nettype wire
