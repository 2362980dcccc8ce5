// l2l_fp32_mul -- IEEE-754 binary32 multiplication y = a * b, round to
// nearest, ties to even; fully pipelined: one operation accepted on every
// clock-enabled cycle, result `L2L_FP32_MUL_LAT (4) ce-cycles later.
//
// Why: every product of the EPS contract (gradient scaling, the AdamW moment
// and decay products) is one binary32 multiplication rounded to nearest even
// with subnormal inputs and results kept, so the multiplier must give exactly
// the bits NumPy's float32 multiplication gives.
//
// How: the 24-bit significands (hidden bit 0 for a subnormal, whose exponent
// counts as 1) are multiplied exactly into 48 bits without normalising the
// inputs first; one leading-zero count on the product then serves both a
// subnormal operand (leading one far down) and a subnormal result (shift
// right instead of left). With E = ea + eb - 126 the biased exponent the
// result would have if the product's leading one were bit 47, the product is
// shifted left by s = min(lz, E - 1), or right by 1 - E when E < 1, so the
// exponent never goes below 1 (exponent 1 with bit 47 clear is a subnormal).
//   stage 1  classify; exponent sum E; two partial products
//            ma * mb[16:0] and ma * mb[23:17] (the split maps onto two
//            27x18 DSP48E2 slices)
//   stage 2  sum of the partial products: the exact 48-bit product
//   stage 3  leading-zero count (of the top 32 product bits: enough, see
//            there), shift direction and amount (right shifts clamped to 25:
//            everything lands in the sticky bit), result exponent
//   stage 4  shift (left or right) with sticky collection, round to nearest even by adding
//            the increment to {exponent, fraction} (a carry out of the
//            fraction bumps the exponent: largest subnormal -> smallest
//            normal, largest finite -> inf), overflow, special cases -> y
//
// Special cases: a NaN operand and 0 * inf give the canonical quiet NaN
// 0x7FC00000; inf * x gives a signed inf; 0 * finite gives a signed zero
// (sign = sign(a) xor sign(b) in every case but NaN).
//
// Interface (fpga/rtl/README.md): (in_valid, a, b) are sampled on a rising
// clk edge with ce = 1 and (out_valid, y) appear LAT ce-cycles later and hold
// while ce = 0. rst is synchronous, active high, acts whatever ce is, and
// clears only the valid chain.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_fp32_mul (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [31:0] a,
    input  wire [31:0] b,
    output wire        out_valid,
    output wire [31:0] y
);

    localparam DEPTH = 4;   // the stages below

    initial begin
        if (DEPTH != `L2L_FP32_MUL_LAT) begin
            $error("l2l_fp32_mul: pipeline depth %0d != L2L_FP32_MUL_LAT %0d",
                   DEPTH, `L2L_FP32_MUL_LAT);
            $finish;
        end
    end

    `include "l2l_lzc.vh"

    // ------------------------------------------------------------------
    // stage 1: classify, exponent sum, partial products
    // ------------------------------------------------------------------
    wire        a_nan  = (a[30:23] == 8'hFF) && (a[22:0] != 23'd0);
    wire        b_nan  = (b[30:23] == 8'hFF) && (b[22:0] != 23'd0);
    wire        a_inf  = (a[30:23] == 8'hFF) && (a[22:0] == 23'd0);
    wire        b_inf  = (b[30:23] == 8'hFF) && (b[22:0] == 23'd0);
    wire        a_zero = (a[30:0] == 31'd0);
    wire        b_zero = (b[30:0] == 31'd0);
    wire [23:0] ma     = {a[30:23] != 8'd0, a[22:0]};
    wire [23:0] mb     = {b[30:23] != 8'd0, b[22:0]};
    wire [9:0]  ea     = (a[30:23] == 8'd0) ? 10'd1 : {2'b00, a[30:23]};
    wire [9:0]  eb     = (b[30:23] == 8'd0) ? 10'd1 : {2'b00, b[30:23]};

    reg         s1_v;
    reg         s1_nan, s1_inf, s1_zero, s1_sign;
    reg  [9:0]  s1_e;                       // E = ea + eb - 126, two's complement
    reg  [40:0] s1_pl;                      // ma * mb[16:0]
    reg  [30:0] s1_ph;                      // ma * mb[23:17]

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= in_valid;
        if (ce) begin
            s1_nan  <= a_nan | b_nan | (a_inf & b_zero) | (a_zero & b_inf);
            s1_inf  <= a_inf | b_inf;
            s1_zero <= a_zero | b_zero;
            s1_sign <= a[31] ^ b[31];
            s1_e    <= ea + eb - 10'd126;
            s1_pl   <= ma * mb[16:0];
            s1_ph   <= ma * mb[23:17];
        end
    end

    // ------------------------------------------------------------------
    // stage 2: the exact product
    // ------------------------------------------------------------------
    reg         s2_v;
    reg         s2_nan, s2_inf, s2_zero, s2_sign;
    reg  [9:0]  s2_e;
    reg  [47:0] s2_p;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_nan  <= s1_nan;
            s2_inf  <= s1_inf;
            s2_zero <= s1_zero;
            s2_sign <= s1_sign;
            s2_e    <= s1_e;
            s2_p    <= {7'd0, s1_pl} + {s1_ph, 17'd0};
        end
    end

    // ------------------------------------------------------------------
    // stage 3: leading zeros, shift amount, result exponent
    // ------------------------------------------------------------------
    // With one normal operand (significand >= 2^23) the product is >= 2^23,
    // so its leading one is in p[47:23] and 32 bits are enough to count; with
    // two subnormal operands E <= -124 and the count is not used (right shift).
    wire [5:0]  lz     = lzc32(s2_p[47:16]);              // 0..24 whenever it is used
    wire        e_pos  = ~s2_e[9] && (s2_e != 10'd0);       // E >= 1
    wire [9:0]  em1    = s2_e - 10'd1;                      // E - 1 (valid when E >= 1)
    wire [9:0]  e_lz   = s2_e - {4'd0, lz};                 // E - lz, next to the compare
    wire        lim    = e_pos && (em1 < {4'd0, lz});       // the exponent floor binds
    wire [5:0]  shl    = !e_pos ? 6'd0 : (lim ? em1[5:0] : lz);
    wire [9:0]  rneg   = 10'd1 - s2_e;                      // 1 - E (valid when E < 1)
    wire [4:0]  shr    = e_pos ? 5'd0 : ((rneg > 10'd25) ? 5'd25 : rneg[4:0]);
    // result exponent E - lz; it only matters when the shifted product keeps
    // bit 47 (a normal result), which happens only when shifting left by lz:
    // at the floor (shift E - 1 < lz) or on a right shift bit 47 is clear and
    // the exponent field is 0 (subnormal)
    wire [9:0]  e_res  = e_lz;

    reg         s3_v;
    reg         s3_nan, s3_inf, s3_zero, s3_sign;
    reg  [9:0]  s3_e;
    reg  [47:0] s3_p;
    reg  [5:0]  s3_shl;
    reg  [4:0]  s3_shr;

    always @(posedge clk) begin
        if (rst)     s3_v <= 1'b0;
        else if (ce) s3_v <= s2_v;
        if (ce) begin
            s3_nan  <= s2_nan;
            s3_inf  <= s2_inf;
            s3_zero <= s2_zero;
            s3_sign <= s2_sign;
            s3_e    <= e_res;
            s3_p    <= s2_p;
            s3_shl  <= shl;
            s3_shr  <= shr;
        end
    end

    // ------------------------------------------------------------------
    // stage 4: shift, sticky, round to nearest even, pack, special cases
    // ------------------------------------------------------------------
    // shl and shr: at most one is nonzero, so the two shifters work side by side
    wire [47:0] n      = (s3_shr != 5'd0) ? (s3_p >> s3_shr) : (s3_p << s3_shl);
    wire        st_out = |(s3_p & ~({48{1'b1}} << s3_shr)); // bits shifted out to the right
    wire        sticky = st_out | (|n[22:0]);
    wire        inc    = n[23] & (sticky | n[24]);
    wire [7:0]  ef     = n[47] ? s3_e[7:0] : 8'd0;          // leading bit clear: subnormal (e = 1)
    wire [30:0] mag    = {ef, n[46:24]} + {30'd0, inc};
    wire        ovf    = (s3_e >= 10'd255) && n[47];      // (s3_e wraps below 0 only when n[47] = 0)

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
            else if (s3_zero)
                s4_y <= {s3_sign, 31'd0};
            else
                s4_y <= {s3_sign, mag};
        end
    end

    assign out_valid = s4_v;
    assign y         = s4_y;

endmodule

`default_nettype wire
