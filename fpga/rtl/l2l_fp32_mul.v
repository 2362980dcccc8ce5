// l2l_fp32_mul -- IEEE-754 binary32 multiplication y = a * b, round to
// nearest, ties to even; fully pipelined: one operation accepted on every
// clock-enabled cycle, result `L2L_FP32_MUL_LAT (8) ce-cycles later.
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
//   stage 0  classify; exponent sum E; significands into flip-flops
//   stage 1  the partial products (below, by DSP_SHAPE), each one hard
//            multiplier straight from flip-flops to flip-flops; E - 1, 1 - E
//   stage 2  DSP_SHAPE = 0: the two middle products summed; DSP_SHAPE = 1:
//            the products registered again (a DSP48's P register); both:
//            right shift amount 1 - E (clamped to 25: everything lands in
//            the sticky bit), a mask that stops the leading-zero count at E - 1
//   stage 3  the exact 48-bit product (one 30- or 31-bit addition)
//   stage 4  leading-zero count of p[47:24] ORed with the mask: the left
//            shift min(lz, E - 1), or 0 for a right shift
//   stage 5  shift (left or right; a right shift keeps the bits it moves out),
//            result exponent E - shift
//   stage 6  sticky bit, rounding increment, exponent field, overflow
//   stage 7  round to nearest even by adding the increment to {exponent,
//            fraction} (a carry out of the fraction bumps the exponent:
//            largest subnormal -> smallest normal, largest finite -> inf),
//            special cases -> y
// Each stage holds one carry chain, one multiplier or a few LUT levels
// (fpga/rtl/timing_ecp5.py measures them; the multipliers are the longest).
//
// DSP_SHAPE picks how the 24x24 significand product is cut into hard
// multipliers; the result, the latency and the interface are the same:
//   0 (default)  18x18 pieces for the ECP5's MULT18X18D: ma[17:0] * mb[17:0],
//                ma[17:0] * mb[23:18], ma[23:18] * mb[17:0], ma[23:18] *
//                mb[23:18] (4 MULT18X18D; yosys maps them to 5 DSP48E1/E2,
//                the 18x18 one needing two: unsigned 18 bits do not fit a
//                signed 18-bit port)
//   1            27x18 pieces for the Xilinx DSP48E2 (UltraScale+), whose
//                multiplier is 27x18 two's complement, so 26x17 unsigned
//                (DSP48E1's 25x18 is 24x17 unsigned): ma * mb[16:0] (24x17)
//                and ma * mb[23:17] (24x7), 2 DSPs, the fewest 24x24 allows
//                (48 product bits > 26 + 17). The sign bits stay 0 (no signed
//                trick would save the second DSP). Stage 1 is the DSP's M
//                register, stage 2 its P register (s0 feeds its A/B
//                registers); stage 3 adds the two in one 31-bit carry chain,
//                p = {ph + pl[40:17], pl[16:0]} (not the DSP's cascade adder:
//                left to the fabric, one carry chain like DSP_SHAPE = 0's)
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

module l2l_fp32_mul #(
    parameter DSP_SHAPE = 0         // 0: 18x18 multipliers (ECP5), 1: 27x18 (Xilinx DSP48E2); header
) (
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,
    input  wire        in_valid,
    input  wire [31:0] a,
    input  wire [31:0] b,
    output wire        out_valid,
    output wire [31:0] y
);

    localparam DEPTH = 8;   // the stages below (0 to 7)

    initial begin
        if (DEPTH != `L2L_FP32_MUL_LAT) begin
            $error("l2l_fp32_mul: pipeline depth %0d != L2L_FP32_MUL_LAT %0d",
                   DEPTH, `L2L_FP32_MUL_LAT);
            $finish;
        end
        if (DSP_SHAPE != 0 && DSP_SHAPE != 1) begin
            $error("l2l_fp32_mul: DSP_SHAPE %0d is not 0 (18x18) or 1 (27x18)", DSP_SHAPE);
            $finish;
        end
    end

    `include "l2l_lzc.vh"

    // ------------------------------------------------------------------
    // stage 0: classify, exponent sum, significands (hidden bit 0 for a
    // subnormal): the multipliers then take their operands from flip-flops
    // ------------------------------------------------------------------
    wire        a_nan  = (a[30:23] == 8'hFF) && (a[22:0] != 23'd0);
    wire        b_nan  = (b[30:23] == 8'hFF) && (b[22:0] != 23'd0);
    wire        a_inf  = (a[30:23] == 8'hFF) && (a[22:0] == 23'd0);
    wire        b_inf  = (b[30:23] == 8'hFF) && (b[22:0] == 23'd0);
    wire        a_zero = (a[30:0] == 31'd0);
    wire        b_zero = (b[30:0] == 31'd0);
    wire [9:0]  ea     = (a[30:23] == 8'd0) ? 10'd1 : {2'b00, a[30:23]};
    wire [9:0]  eb     = (b[30:23] == 8'd0) ? 10'd1 : {2'b00, b[30:23]};

    reg         s0_v;
    reg         s0_nan, s0_inf, s0_zero, s0_sign;
    reg  [9:0]  s0_e;                       // E = ea + eb - 126, two's complement
    reg  [23:0] s0_ma, s0_mb;

    always @(posedge clk) begin
        if (rst)     s0_v <= 1'b0;
        else if (ce) s0_v <= in_valid;
        if (ce) begin
            s0_nan  <= a_nan | b_nan | (a_inf & b_zero) | (a_zero & b_inf);
            s0_inf  <= a_inf | b_inf;
            s0_zero <= a_zero | b_zero;
            s0_sign <= a[31] ^ b[31];
            s0_e    <= ea + eb - 10'd126;
            s0_ma   <= {a[30:23] != 8'd0, a[22:0]};
            s0_mb   <= {b[30:23] != 8'd0, b[22:0]};
        end
    end

    // ------------------------------------------------------------------
    // stages 1 to 3, the product: partial products (stage 1), partly summed
    // or registered again (stage 2), the exact product (stage 3, p_exact)
    // ------------------------------------------------------------------
    wire [47:0] p_exact;                    // from stage 2's registers: s3_p's input

    generate
        if (DSP_SHAPE == 0) begin : g_18x18
            reg  [35:0] s1_pll;             // ma[17:0]  * mb[17:0]
            reg  [23:0] s1_plh;             // ma[17:0]  * mb[23:18]
            reg  [23:0] s1_phl;             // ma[23:18] * mb[17:0]
            reg  [11:0] s1_phh;             // ma[23:18] * mb[23:18]
            reg  [47:0] s2_pq;              // pll and phh side by side: they do not overlap
            reg  [24:0] s2_pm;              // plh + phl, weight 2^18

            always @(posedge clk) begin
                if (ce) begin
                    s1_pll <= s0_ma[17:0] * s0_mb[17:0];
                    s1_plh <= s0_ma[17:0] * s0_mb[23:18];
                    s1_phl <= s0_ma[23:18] * s0_mb[17:0];
                    s1_phh <= s0_ma[23:18] * s0_mb[23:18];
                    s2_pq  <= {s1_phh, s1_pll};
                    s2_pm  <= {1'b0, s1_plh} + {1'b0, s1_phl};
                end
            end

            // the outer products do not overlap: one 30-bit addition
            wire [29:0] p_hi = s2_pq[47:18] + {5'd0, s2_pm};
            assign p_exact = {p_hi, s2_pq[17:0]};
        end else begin : g_27x18
            reg  [40:0] s1_pl;              // ma * mb[16:0]  (24x17), a DSP's M register
            reg  [30:0] s1_ph;              // ma * mb[23:17] (24x7),  a DSP's M register
            reg  [40:0] s2_pl;              // the same, a DSP's P register
            reg  [30:0] s2_ph;

            always @(posedge clk) begin
                if (ce) begin
                    s1_pl <= s0_ma * s0_mb[16:0];
                    s1_ph <= s0_ma * s0_mb[23:17];
                    s2_pl <= s1_pl;
                    s2_ph <= s1_ph;
                end
            end

            // p = ph * 2^17 + pl < 2^48, so p[47:17] = ph + pl[40:17] fits 31 bits
            wire [30:0] p_hi = s2_ph + {7'd0, s2_pl[40:17]};
            assign p_exact = {p_hi, s2_pl[16:0]};
        end
    endgenerate

    // ------------------------------------------------------------------
    // stage 1: the shift cases from E (and the partial products, above)
    // ------------------------------------------------------------------
    reg         s1_v;
    reg         s1_nan, s1_inf, s1_zero, s1_sign;
    reg  [9:0]  s1_e;
    reg         s1_epos;                    // E >= 1: shift left (or not at all)
    reg  [9:0]  s1_em1, s1_rneg;            // E - 1 (used when E >= 1), 1 - E (used when E < 1)

    always @(posedge clk) begin
        if (rst)     s1_v <= 1'b0;
        else if (ce) s1_v <= s0_v;
        if (ce) begin
            s1_nan  <= s0_nan;
            s1_inf  <= s0_inf;
            s1_zero <= s0_zero;
            s1_sign <= s0_sign;
            s1_e    <= s0_e;
            s1_epos <= ~s0_e[9] && (s0_e != 10'd0);
            s1_em1  <= s0_e - 10'd1;
            s1_rneg <= 10'd1 - s0_e;
        end
    end

    // ------------------------------------------------------------------
    // stage 2: right shift amount, left shift limit (and the products, above)
    // ------------------------------------------------------------------

    reg         s2_v;
    reg         s2_nan, s2_inf, s2_zero, s2_sign;
    reg  [9:0]  s2_e;
    reg  [23:0] s2_lzmask;
    reg  [4:0]  s2_shr;

    always @(posedge clk) begin
        if (rst)     s2_v <= 1'b0;
        else if (ce) s2_v <= s1_v;
        if (ce) begin
            s2_nan     <= s1_nan;
            s2_inf     <= s1_inf;
            s2_zero    <= s1_zero;
            s2_sign    <= s1_sign;
            s2_e       <= s1_e;
            // a 1 at bit 23 - (E - 1) of the count's input stops the count at
            // E - 1, the exponent floor (none when E - 1 > 23: the count is
            // at most 24); at bit 23 when E < 1, so the left shift is 0
            s2_lzmask  <= !s1_epos ? 24'h800000 :
                          (s1_em1 <= 10'd23) ? (24'h800000 >> s1_em1[4:0]) : 24'd0;
            s2_shr     <= s1_epos ? 5'd0 : ((s1_rneg > 10'd25) ? 5'd25 : s1_rneg[4:0]);
        end
    end

    // ------------------------------------------------------------------
    // stage 3: the exact product (p_exact, above)
    // ------------------------------------------------------------------
    reg         s3_v;
    reg         s3_nan, s3_inf, s3_zero, s3_sign;
    reg  [9:0]  s3_e;
    reg  [47:0] s3_p;
    reg  [23:0] s3_lzmask;
    reg  [4:0]  s3_shr;

    always @(posedge clk) begin
        if (rst)     s3_v <= 1'b0;
        else if (ce) s3_v <= s2_v;
        if (ce) begin
            s3_nan     <= s2_nan;
            s3_inf     <= s2_inf;
            s3_zero    <= s2_zero;
            s3_sign    <= s2_sign;
            s3_e       <= s2_e;
            s3_p       <= p_exact;
            s3_lzmask  <= s2_lzmask;
            s3_shr     <= s2_shr;
        end
    end

    // ------------------------------------------------------------------
    // stage 4: left shift amount: the leading zeros, limited by the floor
    // ------------------------------------------------------------------
    // With one normal operand (significand >= 2^23) the product is >= 2^23,
    // so its leading one is in p[47:23]: the count of p[47:24] (24 when they
    // are all zero) is the product's. With two subnormal operands E <= -124
    // and the mask makes the count 0 (right shift). The mask makes the count
    // min(lz, E - 1) when E >= 1.
    wire [4:0]  lz     = lzc24(s3_p[47:24] | s3_lzmask);    // 0..24

    reg         s4_v;
    reg         s4_nan, s4_inf, s4_zero, s4_sign;
    reg  [9:0]  s4_e;
    reg  [47:0] s4_p;
    reg  [4:0]  s4_shl;
    reg  [4:0]  s4_shr;

    always @(posedge clk) begin
        if (rst)     s4_v <= 1'b0;
        else if (ce) s4_v <= s3_v;
        if (ce) begin
            s4_nan  <= s3_nan;
            s4_inf  <= s3_inf;
            s4_zero <= s3_zero;
            s4_sign <= s3_sign;
            s4_e    <= s3_e;
            s4_p    <= s3_p;
            s4_shl  <= lz;
            s4_shr  <= s3_shr;
        end
    end

    // ------------------------------------------------------------------
    // stage 5: shift (left or right); a right shift keeps the bits it moves
    // out below the product (25 more bits), for the sticky bit; result
    // exponent
    // ------------------------------------------------------------------
    // shl and shr: at most one is nonzero, so the two shifters work side by side
    wire [72:0] nx_r  = {s4_p, 25'd0} >> s4_shr;
    wire [47:0] nx_l  = s4_p << s4_shl;
    wire [72:0] nx    = (s4_shr != 5'd0) ? nx_r : {nx_l, 25'd0};
    // result exponent E - shl; it only matters when the shifted product keeps
    // bit 47 (a normal result), which happens only when shifting left by the
    // full leading-zero count: at the floor (shift E - 1 < lz) or on a right
    // shift bit 47 is clear and the exponent field is 0 (subnormal)
    wire [9:0]  e_res = s4_e - {5'd0, s4_shl};

    reg         s5_v;
    reg         s5_nan, s5_inf, s5_zero, s5_sign;
    reg  [9:0]  s5_e;
    reg  [72:0] s5_n;                       // the shifted product n = s5_n[72:25], then the bits shifted out

    always @(posedge clk) begin
        if (rst)     s5_v <= 1'b0;
        else if (ce) s5_v <= s4_v;
        if (ce) begin
            s5_nan  <= s4_nan;
            s5_inf  <= s4_inf;
            s5_zero <= s4_zero;
            s5_sign <= s4_sign;
            s5_e    <= e_res;
            s5_n    <= nx;
        end
    end

    // ------------------------------------------------------------------
    // stage 6: sticky bit, rounding increment, exponent field, overflow
    // ------------------------------------------------------------------
    // n = s5_n[72:25] is the shifted product; n[22:0] = s5_n[47:25] only
    // enter the sticky bit, with the bits shifted out (s5_n[24:0])
    wire [24:0] n_hi   = s5_n[72:48];                       // n[47:23]
    wire        sticky = |s5_n[47:0];
    wire        inc    = n_hi[0] & (sticky | n_hi[1]);       // n[23] & (sticky | n[24])
    wire [7:0]  ef     = n_hi[24] ? s5_e[7:0] : 8'd0;       // leading bit clear: subnormal (e = 1)
    wire        ovf    = (s5_e >= 10'd255) && n_hi[24];    // (s5_e wraps below 0 only when n[47] = 0)

    reg         s6_v;
    reg         s6_nan, s6_inf, s6_zero, s6_sign;
    reg         s6_inc, s6_ovf;
    reg  [30:0] s6_m;                       // {exponent field, fraction} before rounding

    always @(posedge clk) begin
        if (rst)     s6_v <= 1'b0;
        else if (ce) s6_v <= s5_v;
        if (ce) begin
            s6_nan  <= s5_nan;
            s6_inf  <= s5_inf;
            s6_zero <= s5_zero;
            s6_sign <= s5_sign;
            s6_inc  <= inc;
            s6_ovf  <= ovf;
            s6_m    <= {ef, n_hi[23:1]};                   // {e, n[46:24]}
        end
    end

    // ------------------------------------------------------------------
    // stage 7: round to nearest even, pack, special cases
    // ------------------------------------------------------------------
    wire [30:0] mag = s6_m + {30'd0, s6_inc};

    reg         s7_v;
    reg  [31:0] s7_y;

    always @(posedge clk) begin
        if (rst)     s7_v <= 1'b0;
        else if (ce) s7_v <= s6_v;
        if (ce) begin
            if (s6_nan)
                s7_y <= 32'h7FC00000;
            else if (s6_inf | s6_ovf)
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
