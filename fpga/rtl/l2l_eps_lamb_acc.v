// l2l_eps_lamb_acc -- one of LAMB's segment sums in the RTL EPS: 16 interleaved
// binary32 accumulators fed by one pipelined l2l_fp32_add at one element per
// clock (docs/eps-numerics.md "LAMB update": lane j of a segment takes its
// elements j, j + 16, ... counted from the segment's start, in index order,
// from +0, acc_j <- acc_j + x, one rounded addition each).
//
// Why a ring: the adder's result for element k is needed again by element
// k + 16 of the segment, at least 16 ce-cycles later; the operand is chosen
// (the ring's lane, or +0) and registered one clock before the adder, so with
// the adder's latency LA <= 15 the result is back in the ring by then (at
// LA = 15 through the write-back bypass), and the adder takes one element
// every clock. The first 16 elements of a segment add to +0 (one real
// addition: +0 + x rounds as the contract's does, a -0 becoming +0).
//
// Why the operand register: the lane select (a 16:1 mux of 32 bits behind the
// first-element test) in the same clock as the adder's first stage was the
// longest path of the LAMB datapath on the ECP5 (80 MHz, fpga/rtl/README.md).
//
// in_first marks a segment's first element (the lane count restarts at 0),
// in_last its last one. When the last element's sum leaves the adder, the 16
// accumulators -- lanes the segment never reached (segments shorter than 16)
// as +0 -- are copied, lane j in bits [32j +: 32], to the sums register and
// sums_valid rises (LA + 1 ce-cycles after that element came in); it falls
// when sums_ready is high. The next segment's first
// write-back comes at least one ce-cycle later, so segments can follow back to
// back; but the caller must hold ce low while sums_valid is high (the register
// is the only copy): l2l_eps_lamb_norms has ce = skid empty AND NOT sums_valid,
// both flip-flops.
`default_nettype none
`include "l2l_fp_latency.vh"

module l2l_eps_lamb_acc (
    input  wire          clk,
    input  wire          rst,
    input  wire          ce,
    input  wire          in_valid,
    input  wire          in_first,    // first element of a segment
    input  wire          in_last,     // last element of a segment
    input  wire [31:0]   in_x,
    output reg           sums_valid,  // rises LA + 1 ce-cycles after the segment's last element
    output reg  [511:0]  sums,        // lane j at [32j +: 32]
    input  wire          sums_ready   // sums taken (ce must be low while sums_valid)
);

    localparam LA = `L2L_FP32_ADD_LAT;

    initial begin
        if (LA > 15) begin
            $error("l2l_eps_lamb_acc: adder latency %0d > 15 (the ring has 16 lanes, one clock is the operand's)", LA);
            $finish;
        end
    end

    reg  [31:0] acc [0:15];
    reg  [15:0] written;            // lanes written in the current segment
    reg  [3:0]  lane;               // the previous element's lane
    reg         wrapped;            // the previous element was past the segment's first 16

    // the element now at the input
    wire [3:0]  j    = in_first ? 4'd0 : lane + 4'd1;
    wire        wrap = in_first ? 1'b0 : (wrapped || lane == 4'd15);

    // the adder's write-back
    wire        wb_valid;
    wire [31:0] wb_y;
    wire [3:0]  wb_j;
    wire        wb_last;

    wire [31:0] ring = (wb_valid && wb_j == j) ? wb_y : acc[j];   // bypass: LA = 15
    wire [31:0] a    = wrap ? ring : 32'h00000000;

    // the operand, the element and its lane, registered in front of the adder
    reg         op_valid, op_last;
    reg  [3:0]  op_j;
    reg  [31:0] op_a, op_x;
    always @(posedge clk) begin
        if (rst) begin
            op_valid <= 1'b0;
        end else if (ce) begin
            op_valid <= in_valid;
            op_last  <= in_last;
            op_j     <= j;
            op_a     <= a;
            op_x     <= in_x;
        end
    end

    l2l_fp32_add u_add (.clk(clk), .rst(rst), .ce(ce), .in_valid(op_valid), .a(op_a), .b(op_x), .sub(1'b0),
                        .out_valid(wb_valid), .y(wb_y));
    l2l_delay #(.WIDTH(5), .DEPTH(LA)) d_j (.clk(clk), .rst(rst), .ce(ce), .d({op_last, op_j}),
                                           .q({wb_last, wb_j}));

    always @(posedge clk) begin
        if (rst) begin
            lane    <= 4'd15;
            wrapped <= 1'b0;
        end else if (ce && in_valid) begin
            lane    <= j;
            wrapped <= wrap;
        end
    end

    integer k;
    always @(posedge clk) begin
        if (rst) begin
            written    <= 16'd0;
            sums_valid <= 1'b0;
        end else begin
            if (sums_valid && sums_ready)
                sums_valid <= 1'b0;
            if (ce && wb_valid) begin
                acc[wb_j] <= wb_y;
                if (wb_last) begin
                    for (k = 0; k < 16; k = k + 1)
                        sums[32*k +: 32] <= (k[3:0] == wb_j) ? wb_y : (written[k] ? acc[k] : 32'h00000000);
                    written    <= 16'd0;
                    sums_valid <= 1'b1;
                end else begin
                    written[wb_j] <= 1'b1;
                end
            end
        end
    end

endmodule

`default_nettype wire
