// l2l_cvt_fp32_to_fp16 -- narrowing conversion of an IEEE-754 binary32
// a[31:0] to binary16 y[15:0], round to nearest, ties to even, binary16
// subnormals produced, overflow to a signed infinity. Fully pipelined: one
// conversion accepted on every clock-enabled cycle, result
// `L2L_CVT_NARROW_LAT (3) ce-cycles later.
//
// Why: the EPS writes the device copy of p' as binary16 when the device
// computes in binary16; the contract rounds it to nearest even, gives inf
// with the sign of p' on overflow, keeps binary16 subnormals and keeps NaN a
// NaN.
//
// How: with e the binary32 biased exponent and sig = {1, fraction} (24 bits),
// the binary16 exponent would be e - 112. When that is >= 1 the result is
// sig >> 13 under exponent e - 112; when it is <= 0 the result is the
// binary16 subnormal sig >> (126 - e) under exponent field 0 (shift clamped
// to 25: from there on every bit is below the rounding point, and only the
// sticky bit remains). One right shift therefore serves both cases; the
// shifted-out bits give the guard bit and the sticky bit. Rounding adds the
// increment to {exponent, fraction}: a carry out of the fraction bumps the
// exponent, so the largest subnormal rounds to the smallest normal and
// values from 65520 up round to infinity (exponent field 31, fraction 0).
// A binary32 exponent of 143 or more (|a| >= 65536) is infinity outright.
// binary32 subnormals (< 2^-126) round to a signed zero. A NaN keeps its
// sign and the top of its payload and is made quiet (fraction bit 9 set).
//   stage 1  classify, shift amount, exponent field
//   stage 2  aligned significand, guard and sticky
//   stage 3  round to nearest even, pack, special cases -> y
//
// Interface (fpga/rtl/README.md): (in_valid, a[31:0]) are sampled on a
// rising clk edge with ce = 1 and (out_valid, y[15:0]) appear LAT ce-cycles
// later and hold while ce = 0. rst is synchronous, active high, acts
// whatever ce is, and clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_cvt_fp32_to_fp16 (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [31:0] a,
    output wire        out_valid,
    output wire [15:0] y
);

    localparam DEPTH = 3;   // the stages below

    initial begin
        if (DEPTH != `L2L_CVT_NARROW_LAT) begin
            $error("l2l_cvt_fp32_to_fp16: pipeline depth %0d != L2L_CVT_NARROW_LAT %0d",
                   DEPTH, `L2L_CVT_NARROW_LAT);
            $finish;
        end
    end

    // ------------------------------------------------------------------
    // stage 1: classify, shift amount, exponent field
    // ------------------------------------------------------------------
    wire [7:0]  e      = a[30:23];
    wire        is_nan = (e == 8'hFF) && (a[22:0] != 23'd0);
    wire        big    = (e >= 8'd143);                     // |a| >= 2^16, or inf
    wire        normal = (e >= 8'd113);                     // binary16 exponent e - 112 >= 1
    wire        tiny   = (e == 8'd0);                       // zero or binary32 subnormal: result 0
    // right shift by 13 + sh: 13 for a binary16 normal, 126 - e (14..25) for
    // a subnormal; for e in 102..112, 126 - e - 13 = 17 - e[4:0] (mod 32)
    wire [3:0]  sh     = normal ? 4'd0 : ((e <= 8'd101) ? 4'd12 : (4'd1 - e[3:0]));
    wire [4:0]  ef     = normal ? (e[4:0] - 5'd16) : 5'd0;  // e - 112 (mod 32), 1..30

    reg         s1_v;
    reg         s1_sign, s1_nan, s1_big, s1_tiny;
    reg  [4:0]  s1_ef;
    reg  [3:0]  s1_sh;
    reg  [22:0] s1_f;

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_sign <= a[31];
            s1_nan  <= is_nan;
            s1_big  <= big;
            s1_tiny <= tiny;
            s1_ef   <= ef;
            s1_sh   <= sh;
            s1_f    <= a[22:0];
        end
    end

    // ------------------------------------------------------------------
    // stage 2: align, guard and sticky
    // ------------------------------------------------------------------
    // {sig, 26 zeros} >> (13 + sh) = {sig, 13 zeros} >> sh, and that loses
    // nothing: the low 26 bits hold the guard bit and the sticky bits. w[36]
    // is the hidden bit when normal, not needed (the exponent field is s1_ef)
    /* verilator lint_off UNUSEDSIGNAL */
    wire [36:0] w      = {1'b1, s1_f, 13'd0} >> s1_sh;
    /* verilator lint_on UNUSEDSIGNAL */
    wire [9:0]  q      = w[35:26];
    wire        guard  = w[25];
    wire        sticky = |w[24:0];

    reg         s2_v;
    reg         s2_sign, s2_nan, s2_big, s2_tiny;
    reg  [4:0]  s2_ef;
    reg  [9:0]  s2_frac;
    reg         s2_guard, s2_sticky;
    reg  [8:0]  s2_payload;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_sign    <= s1_sign;
            s2_nan     <= s1_nan;
            s2_big     <= s1_big;
            s2_tiny    <= s1_tiny;
            s2_ef      <= s1_ef;
            s2_frac    <= q;
            s2_guard   <= guard;
            s2_sticky  <= sticky;
            s2_payload <= s1_f[21:13];
        end
    end

    // ------------------------------------------------------------------
    // stage 3: round to nearest even, pack, special cases
    // ------------------------------------------------------------------
    wire        inc = s2_guard & (s2_sticky | s2_frac[0]);
    wire [14:0] mag = {s2_ef, s2_frac} + {14'd0, inc};    // 0x7BFF + 1 = 0x7C00: inf

    reg         s3_v;
    reg  [15:0] s3_y;

    always @(posedge clk) begin
        if (rst)     s3_v <= 1'b0;
        else if (ce) s3_v <= s2_v;
        if (ce) begin
            if (s2_nan)
                s3_y <= {s2_sign, 5'h1F, 1'b1, s2_payload};
            else if (s2_big)
                s3_y <= {s2_sign, 15'h7C00};
            else if (s2_tiny)
                s3_y <= {s2_sign, 15'd0};
            else
                s3_y <= {s2_sign, mag};
        end
    end

    assign out_valid = s3_v;
    assign y         = s3_y;

endmodule

`default_nettype wire
