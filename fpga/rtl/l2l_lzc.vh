// l2l_lzc.vh -- leading-zero counters for the FP units, and the whole-byte
// normalising shift that goes with lzc24, as Verilog functions.
// `include this file inside a module body (functions live in module scope).
// Two shapes, kept for their logic depth: lzc32 counts in two levels (the
// count within each byte beside which byte holds the leading one), lzc24 is
// a log-depth tree. Both are a few LUT levels, not a priority chain, and
// both simulate fast in Icarus.

    // leading zeros of a nonzero byte (0..7; a zero byte is never asked)
    function [2:0] lzc8;
        input [7:0] x;
        casez (x)
            8'b1???????: lzc8 = 3'd0;
            8'b01??????: lzc8 = 3'd1;
            8'b001?????: lzc8 = 3'd2;
            8'b0001????: lzc8 = 3'd3;
            8'b00001???: lzc8 = 3'd4;
            8'b000001??: lzc8 = 3'd5;
            8'b0000001?: lzc8 = 3'd6;
            8'b00000001: lzc8 = 3'd7;
            default:     lzc8 = 3'd7;
        endcase
    endfunction

    // leading zeros of a 32-bit vector (32 when it is zero), in two levels:
    // the count within each byte and, next to it, which byte holds the
    // leading one (a few LUT levels, not a 32-deep priority chain)
    function [5:0] lzc32;
        input [31:0] x;
        reg   [3:0]  nz;                       // byte k (k = 3: most significant) is not zero
        begin
            nz = {|x[31:24], |x[23:16], |x[15:8], |x[7:0]};
            casez (nz)
                4'b1???: lzc32 = {3'd0, lzc8(x[31:24])};
                4'b01??: lzc32 = {3'd1, lzc8(x[23:16])};
                4'b001?: lzc32 = {3'd2, lzc8(x[15:8])};
                4'b0001: lzc32 = {3'd3, lzc8(x[7:0])};
                default: lzc32 = 6'd32;
            endcase
        end
    endfunction

    // leading zeros of a 24-bit significand (24 when it is zero), as a
    // log-depth tree: the count of each 2^k-bit group is either the count of
    // its upper half or 2^(k-1) plus the count of its lower half. A 1 padded
    // in below the significand bounds the count at 24.
    function [4:0] lzc24;
        input [23:0] sig;
        reg [31:0] x;
        reg [15:0] v1, p1;      // 16 groups of 2 bits: any one, count (1 bit)
        reg [7:0]  v2;
        reg [15:0] p2;          // 8 groups of 4: 2-bit counts
        reg [3:0]  v3;
        reg [11:0] p3;          // 4 groups of 8: 3-bit counts
        reg        v4;          // the upper group of 16 has a one (the lower one's flag is not needed)
        reg [7:0]  p4;          // 2 groups of 16: 4-bit counts
        integer g;
        begin
            x = {sig, 1'b1, 7'd0};
            for (g = 0; g < 16; g = g + 1) begin
                v1[g] = x[2*g+1] | x[2*g];
                p1[g] = ~x[2*g+1];
            end
            for (g = 0; g < 8; g = g + 1) begin
                v2[g]        = v1[2*g+1] | v1[2*g];
                p2[2*g +: 2] = v1[2*g+1] ? {1'b0, p1[2*g+1]} : {1'b1, p1[2*g]};
            end
            for (g = 0; g < 4; g = g + 1) begin
                v3[g]        = v2[2*g+1] | v2[2*g];
                p3[3*g +: 3] = v2[2*g+1] ? {1'b0, p2[2*(2*g+1) +: 2]} : {1'b1, p2[2*(2*g) +: 2]};
            end
            for (g = 0; g < 2; g = g + 1)
                p4[4*g +: 4] = v3[2*g+1] ? {1'b0, p3[3*(2*g+1) +: 3]} : {1'b1, p3[3*(2*g) +: 3]};
            v4    = v3[3] | v3[2];
            lzc24 = v4 ? {1'b0, p4[7:4]} : {1'b1, p4[3:0]};
        end
    endfunction

    // A 24-bit significand shifted left past its all-zero leading bytes (0, 1
    // or 2 of them: 8 * lzc24(sig)[4:3] bits), so that the next stage has only
    // the shift by lzc24(sig)[2:0] left to do (the divider's and the square
    // root's normalisation, split over two stages). A zero significand gives 0.
    function [23:0] byte_norm;
        input [23:0] sig;
        casez ({|sig[23:16], |sig[15:8]})
            2'b1?:   byte_norm = sig;
            2'b01:   byte_norm = {sig[15:0], 8'd0};
            default: byte_norm = {sig[7:0], 16'd0};
        endcase
    endfunction
