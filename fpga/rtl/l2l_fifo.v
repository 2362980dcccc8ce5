// l2l_fifo -- synchronous first-word-fall-through FIFO with a registered read
// port, for the AXI DMA engines of the EPS kernel.
//
// What: s_* writes one WIDTH-bit item per clock while s_ready; m_* offers the
// oldest item (m_valid/m_data) until m_ready takes it. Up to DEPTH = 2**AW items sit
// in the memory and one more in the output register, so `count` (items
// inside, output register included) goes up to DEPTH + 1. An item written on
// an edge appears on m_* two edges later. Both ports run at one item per
// clock together.
//
// Why this shape: the memory is written and read on clock edges only (no
// asynchronous read), so a synthesis tool maps a deep, wide FIFO (the DMA
// read buffers hold BURST-sized bursts of 32*LANES-bit beats) onto block RAM;
// the read lands in an output register that doubles as the FWFT stage. s_ready
// depends only on registers (never on s_valid or m_ready), so the FIFO can sit
// on both sides of a handshake without a combinational path through it.
`default_nettype none

module l2l_fifo #(
    parameter WIDTH = 32,   // bits per item, >= 1
    parameter AW    = 4     // address bits, >= 1: the memory holds DEPTH = 2**AW items
) (
    input  wire             clk,
    input  wire             rst,        // synchronous, active high: empties the FIFO
    input  wire             s_valid,
    output wire             s_ready,
    input  wire [WIDTH-1:0] s_data,
    output wire             m_valid,
    input  wire             m_ready,
    output wire [WIDTH-1:0] m_data,
    output wire [AW:0]      count       // items inside, 0 .. DEPTH + 1
);

    localparam DEPTH = 1 << AW;

    initial begin
        if (WIDTH < 1 || AW < 1 || AW > 20) begin
            $error("l2l_fifo: illegal parameters WIDTH=%0d AW=%0d (1 .. 20)", WIDTH, AW);
            $finish;
        end
    end

    reg [WIDTH-1:0] mem [0:DEPTH-1];
    reg [AW-1:0]    wr_ptr, rd_ptr;
    reg [AW:0]      mem_count;      // items in the memory
    reg             out_valid;
    reg [WIDTH-1:0] out_data;

    wire push = s_valid && s_ready;
    // move the oldest memory item into the output register when it is empty or being taken
    wire pull = (mem_count != 0) && (!out_valid || m_ready);

    assign s_ready = (mem_count != DEPTH);
    assign m_valid = out_valid;
    assign m_data  = out_data;
    assign count   = mem_count + {{AW{1'b0}}, out_valid};

    always @(posedge clk) begin
        if (push)
            mem[wr_ptr] <= s_data;
        if (pull)
            out_data <= mem[rd_ptr];
    end

    always @(posedge clk) begin
        if (rst) begin
            wr_ptr    <= {AW{1'b0}};
            rd_ptr    <= {AW{1'b0}};
            mem_count <= {(AW + 1){1'b0}};
            out_valid <= 1'b0;
        end else begin
            if (push)
                wr_ptr <= wr_ptr + 1'b1;
            if (pull)
                rd_ptr <= rd_ptr + 1'b1;
            mem_count <= mem_count + {{AW{1'b0}}, push} - {{AW{1'b0}}, pull};
            if (pull)
                out_valid <= 1'b1;
            else if (m_ready)
                out_valid <= 1'b0;
        end
    end

endmodule

`default_nettype wire
