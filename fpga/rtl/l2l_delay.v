// l2l_delay -- a clock-enabled delay line of DEPTH register stages.
//
// What: q is d as it was sampled DEPTH clock-enabled cycles earlier (DEPTH = 0
// is a wire). The line advances only on a rising edge with ce = 1, exactly
// like the floating-point units of fpga/rtl, so a bypass operand delayed by a
// unit's L2L_*_LAT arrives at the next unit together with that unit's result
// whatever the stall pattern was.
//
// Why: the AdamW datapath and the reducer compose the FP units by delay
// matching (no handshakes inside the pipeline). Every operand that skips a
// unit (p*decay waiting for the update term, m' waiting for the divider, the
// sidebands tkeep/tlast, ...) goes through one of these.
//
// RESET = 1 clears the stages on rst (use it for valid bits only); with
// RESET = 0 the line has no reset, so a synthesis tool may map it to shift
// register primitives (SRL) instead of flip-flops.
`default_nettype none

module l2l_delay #(
    parameter WIDTH = 1,    // bits per stage, >= 1
    parameter DEPTH = 1,    // stages, >= 0 (0: q = d)
    parameter RESET = 0     // 1: synchronous reset of every stage to 0
) (
    // DEPTH = 0 is a wire: clk, rst and ce go unused
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire             clk,
    input  wire             rst,
    input  wire             ce,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire [WIDTH-1:0] d,
    output wire [WIDTH-1:0] q
);

    initial begin
        if (WIDTH < 1 || DEPTH < 0 || (RESET != 0 && RESET != 1)) begin
            $error("l2l_delay: illegal parameters WIDTH=%0d DEPTH=%0d RESET=%0d", WIDTH, DEPTH, RESET);
            $finish;
        end
    end

    generate
        if (DEPTH == 0) begin : g_wire
            assign q = d;
        end else if (DEPTH == 1) begin : g_one
            reg [WIDTH-1:0] r;
            always @(posedge clk) begin
                if (RESET != 0 && rst)
                    r <= {WIDTH{1'b0}};
                else if (ce)
                    r <= d;
            end
            assign q = r;
        end else begin : g_line
            // stage 0 in the low WIDTH bits, the oldest stage in the top WIDTH bits
            reg [WIDTH*DEPTH-1:0] r;
            always @(posedge clk) begin
                if (RESET != 0 && rst)
                    r <= {(WIDTH*DEPTH){1'b0}};
                else if (ce)
                    r <= {r[WIDTH*(DEPTH-1)-1:0], d};
            end
            assign q = r[WIDTH*DEPTH-1 -: WIDTH];
        end
    endgenerate

endmodule

`default_nettype wire
