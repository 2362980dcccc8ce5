// l2l_pipe_skid -- the exit of a clock-enabled pipeline onto an AXI-Stream
// master, with one skid register, so that the pipeline's clock enable is a
// flip-flop output and never a combinational function of m_ready.
//
// What: the pipeline (delay-matched FP units, no internal handshakes) runs
// while ce = 1. Its last stage (pipe_valid, pipe_data) is offered on m_*.
// When the consumer does not take it, the item is caught in the skid register
// on the same edge the pipeline advances, and ce drops to 0 (freezing the
// whole pipeline, its new last item included) until the consumer takes the
// skid item. With m_ready always 1 the skid register never fills and ce stays
// 1: one item per clock. Under backpressure the throughput is that of m_ready.
//
// Why: the obvious "ce = m_ready || !out_valid" puts m_ready combinationally
// on s_axis_tready and on the enable of every pipeline register. Here ce (and
// so the pipeline's s_axis_tready) is a flip-flop (skid register empty);
// m_valid and m_data are a 2:1 mux of the last pipeline stage and the skid
// register.
// AXI-Stream rule kept: a valid item offered on m_* stays there, unchanged,
// until m_ready (the skid holds exactly what was offered).
`default_nettype none

module l2l_pipe_skid #(
    parameter WIDTH = 32        // payload bits per item, >= 1
) (
    input  wire             clk,
    input  wire             rst,        // synchronous, active high: empties the skid register
    output wire             ce,         // clock enable of the pipeline feeding pipe_*
    input  wire             pipe_valid, // last pipeline stage
    input  wire [WIDTH-1:0] pipe_data,
    output wire             m_valid,
    output wire [WIDTH-1:0] m_data,
    input  wire             m_ready
);

    initial begin
        if (WIDTH < 1) begin
            $error("l2l_pipe_skid: illegal WIDTH=%0d", WIDTH);
            $finish;
        end
    end

    // the skid register is empty: kept as its own flip-flop (not !skid_valid) so that the
    // enable of every pipeline register is a positive-polarity flop output (FPGA CE pins,
    // and shift-register (SRL) extraction of the delay lines, want that)
    reg             skid_empty;
    reg [WIDTH-1:0] skid_data;

    assign ce      = skid_empty;
    assign m_valid = !skid_empty || pipe_valid;
    assign m_data  = skid_empty ? pipe_data : skid_data;

    always @(posedge clk) begin
        if (rst) begin
            skid_empty <= 1'b1;
        end else if (!skid_empty) begin
            if (m_ready)
                skid_empty <= 1'b1;             // taken; the frozen pipeline item is next
        end else if (pipe_valid && !m_ready) begin
            skid_empty <= 1'b0;                 // not taken while the pipeline advances: keep it
        end
    end

    always @(posedge clk) begin
        if (skid_empty)
            skid_data <= pipe_data;             // only looked at once the skid register is full
    end

endmodule

`default_nettype wire
