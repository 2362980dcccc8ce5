// l2l_dma_loop -- test harness (simulation only): the EPS kernel's read engine
// feeding its write engine through one AXI4 master, so a cocotb testbench
// (sim/tb_axi_dma.py) can check that a range read from any element offset
// comes out realigned, in order, with the right tkeep/tlast, and is written
// back exactly (strobes included) under random AXI and stream backpressure.
//
// The stream between the engines is tapped on the ports st_* (what the read
// engine offers and whether it is taken) and gated by `stall` (1: neither side
// of the stream moves this cycle), which the testbench drives at random.
`default_nettype none

module l2l_dma_loop #(
    parameter LANES      = 4,
    parameter EW         = 32,
    parameter BURST      = 8,
    parameter FIFO_DEPTH = 16
) (
    input  wire                  clk,
    input  wire                  rst,
    input  wire                  stall,
    input  wire                  rd_cmd_valid,
    output wire                  rd_cmd_ready,
    input  wire [63:0]           rd_cmd_addr,
    input  wire [31:0]           rd_cmd_len,
    input  wire                  wr_cmd_valid,
    output wire                  wr_cmd_ready,
    input  wire [63:0]           wr_cmd_addr,
    input  wire [31:0]           wr_cmd_len,
    output wire                  rd_idle,
    output wire                  wr_idle,
    output wire [EW*LANES-1:0]   st_tdata,
    output wire [LANES-1:0]      st_tkeep,
    output wire                  st_tlast,
    output wire                  st_tvalid,
    output wire                  st_take,
    output wire [0:0]            m_axi_awid,
    output wire [63:0]           m_axi_awaddr,
    output wire [7:0]            m_axi_awlen,
    output wire [2:0]            m_axi_awsize,
    output wire [1:0]            m_axi_awburst,
    output wire                  m_axi_awvalid,
    input  wire                  m_axi_awready,
    output wire [EW*LANES-1:0]   m_axi_wdata,
    output wire [EW*LANES/8-1:0] m_axi_wstrb,
    output wire                  m_axi_wlast,
    output wire                  m_axi_wvalid,
    input  wire                  m_axi_wready,
    input  wire [0:0]            m_axi_bid,
    input  wire [1:0]            m_axi_bresp,
    input  wire                  m_axi_bvalid,
    output wire                  m_axi_bready,
    output wire [0:0]            m_axi_arid,
    output wire [63:0]           m_axi_araddr,
    output wire [7:0]            m_axi_arlen,
    output wire [2:0]            m_axi_arsize,
    output wire [1:0]            m_axi_arburst,
    output wire                  m_axi_arvalid,
    input  wire                  m_axi_arready,
    input  wire [0:0]            m_axi_rid,
    input  wire [EW*LANES-1:0]   m_axi_rdata,
    input  wire [1:0]            m_axi_rresp,
    input  wire                  m_axi_rlast,
    input  wire                  m_axi_rvalid,
    output wire                  m_axi_rready
);

    wire rd_tready, wr_tready;

    l2l_axi_rd #(.LANES(LANES), .EW(EW), .BURST(BURST), .FIFO_DEPTH(FIFO_DEPTH)) u_rd (
        .clk(clk), .rst(rst),
        .cmd_valid(rd_cmd_valid), .cmd_ready(rd_cmd_ready), .cmd_addr(rd_cmd_addr), .cmd_len(rd_cmd_len),
        .m_axis_tdata(st_tdata), .m_axis_tkeep(st_tkeep), .m_axis_tlast(st_tlast),
        .m_axis_tvalid(st_tvalid), .m_axis_tready(rd_tready), .idle(rd_idle),
        .m_axi_arid(m_axi_arid), .m_axi_araddr(m_axi_araddr), .m_axi_arlen(m_axi_arlen),
        .m_axi_arsize(m_axi_arsize), .m_axi_arburst(m_axi_arburst), .m_axi_arvalid(m_axi_arvalid),
        .m_axi_arready(m_axi_arready), .m_axi_rid(m_axi_rid), .m_axi_rdata(m_axi_rdata),
        .m_axi_rresp(m_axi_rresp), .m_axi_rlast(m_axi_rlast), .m_axi_rvalid(m_axi_rvalid),
        .m_axi_rready(m_axi_rready));

    assign rd_tready = wr_tready && !stall;
    assign st_take   = st_tvalid && rd_tready;

    l2l_axi_wr #(.LANES(LANES), .EW(EW), .BURST(BURST), .FIFO_DEPTH(FIFO_DEPTH)) u_wr (
        .clk(clk), .rst(rst),
        .cmd_valid(wr_cmd_valid), .cmd_ready(wr_cmd_ready), .cmd_addr(wr_cmd_addr), .cmd_len(wr_cmd_len),
        .s_axis_tdata(st_tdata), .s_axis_tkeep(st_tkeep), .s_axis_tvalid(st_tvalid && !stall),
        .s_axis_tready(wr_tready), .idle(wr_idle),
        .m_axi_awid(m_axi_awid), .m_axi_awaddr(m_axi_awaddr), .m_axi_awlen(m_axi_awlen),
        .m_axi_awsize(m_axi_awsize), .m_axi_awburst(m_axi_awburst), .m_axi_awvalid(m_axi_awvalid),
        .m_axi_awready(m_axi_awready), .m_axi_wdata(m_axi_wdata), .m_axi_wstrb(m_axi_wstrb),
        .m_axi_wlast(m_axi_wlast), .m_axi_wvalid(m_axi_wvalid), .m_axi_wready(m_axi_wready),
        .m_axi_bid(m_axi_bid), .m_axi_bresp(m_axi_bresp), .m_axi_bvalid(m_axi_bvalid),
        .m_axi_bready(m_axi_bready));

endmodule

`default_nettype wire
