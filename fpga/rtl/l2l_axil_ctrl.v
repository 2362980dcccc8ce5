// l2l_axil_ctrl -- the EPS RTL kernel's AXI4-Lite control slave: the Vitis
// ap_ctrl_hs register file and the kernel arguments of fpga/ARGS.md.
//
// What: the host (XRT) starts the kernel and passes its arguments through
// these registers, exactly as it does for an HLS kernel:
//
//   0x00 control  bit0 ap_start  R/W  set by the host; cleared when the kernel
//                                     takes the start (ap_ready), unless auto_restart
//                 bit1 ap_done   R    set when a run ends; cleared when 0x00 is read
//                 bit2 ap_idle   R    the kernel is idle
//                 bit3 ap_ready  R    set when the kernel takes a start (arguments
//                                     latched, the next ones may be written);
//                                     cleared when 0x00 is read
//                 bit7 auto_restart R/W  restart by itself after each run
//   0x04 GIE      bit0 global interrupt enable
//   0x08 IER      bit0 ap_done interrupt enable, bit1 ap_ready interrupt enable
//   0x0C ISR      bit0 ap_done, bit1 ap_ready interrupt status; a 1 written toggles the bit
//   0x10 ..       the arguments of eps_update_<g>_<c> in the shared order
//                 (fpga/ARGS.md): the buffers gr, p, m, v, copy, finite as 64-bit
//                 byte addresses (8 bytes each: low word, then high word), then
//                 n, k, n_decay and the nine step scalars (4 bytes each, binary32
//                 bits for the scalars). The ADDR_* localparams below are the map.
//   0x70 status   bit0 dma_error R  an AXI read or write response of the last run
//                                     was SLVERR or DECERR (the `dma_error` input;
//                                     the kernel clears it when a run starts)
//   0x74 ..       LAMB = 1 only (the LAMB kernel, fpga/ARGS.md "RTL kernel", "LAMB"):
//                 pass (32), then the buffers seg, sums, steps (64 each), then nseg
//                 (32): the LAMB_ADDR_* localparams; the map then ends at 0x94.
//
// `interrupt` = GIE & (ISR bit0 | ISR bit1). Every register reads back what
// was written (unused bits read 0); status is read-only. Unmapped addresses
// read 0 and ignore writes; responses are always OKAY.
//
// Why: Vitis runs an RTL kernel through the same ap_ctrl_hs protocol and a
// register map declared in kernel.xml; the one argument order shared with the
// OpenCL and HLS kernels lets one host driver run any of them. The map is
// compact (8 bytes per buffer, 4 per scalar, no reserved words), as ARGS.md
// states for an ap_ctrl_hs map; kernel.xml gives XRT these offsets.
`default_nettype none

module l2l_axil_ctrl #(
    parameter ADDR_W = 12,   // address bits of s_axi_control, 7 .. 32 (8 with LAMB; the map ends at 0x74,
                             // 0x94 with LAMB; Vitis uses 12)
    parameter LAMB   = 0     // 1: the LAMB kernel's words past the status register
) (
    input  wire              clk,
    input  wire              rst,          // synchronous, active high
    // AXI4-Lite slave
    input  wire [ADDR_W-1:0] s_axi_control_awaddr,
    input  wire              s_axi_control_awvalid,
    output wire              s_axi_control_awready,
    input  wire [31:0]       s_axi_control_wdata,
    input  wire [3:0]        s_axi_control_wstrb,
    input  wire              s_axi_control_wvalid,
    output wire              s_axi_control_wready,
    output wire [1:0]        s_axi_control_bresp,
    output reg               s_axi_control_bvalid,
    input  wire              s_axi_control_bready,
    input  wire [ADDR_W-1:0] s_axi_control_araddr,
    input  wire              s_axi_control_arvalid,
    output wire              s_axi_control_arready,
    output reg  [31:0]       s_axi_control_rdata,
    output wire [1:0]        s_axi_control_rresp,
    output reg               s_axi_control_rvalid,
    input  wire              s_axi_control_rready,
    // the name Vitis requires of an RTL kernel's interrupt (a C++ word to Verilator)
    /* verilator lint_off SYMRSVDWORD */
    output wire              interrupt,
    /* verilator lint_on SYMRSVDWORD */
    // to and from the kernel core
    output wire              ap_start,
    input  wire              ap_ready,     // pulse: the core took the start
    input  wire              ap_done,      // pulse: the run ended
    input  wire              ap_idle,
    input  wire              dma_error,    // the run's status bit (0x70)
    output wire [63:0]       arg_gr,
    output wire [63:0]       arg_p,
    output wire [63:0]       arg_m,
    output wire [63:0]       arg_v,
    output wire [63:0]       arg_copy,
    output wire [63:0]       arg_finite,
    output wire [31:0]       arg_n,
    output wire [31:0]       arg_k,
    output wire [31:0]       arg_n_decay,
    output wire [31:0]       arg_decay,
    output wire [31:0]       arg_b1,
    output wire [31:0]       arg_omb1,
    output wire [31:0]       arg_b2,
    output wire [31:0]       arg_omb2,
    output wire [31:0]       arg_inv_bc2_sqrt,
    output wire [31:0]       arg_eps,
    output wire [31:0]       arg_neg_step,
    output wire [31:0]       arg_inv_scale,
    // LAMB = 1: its pass, segment bounds, sums, steps and segment count (0 otherwise)
    output wire [31:0]       arg_pass,
    output wire [63:0]       arg_seg,
    output wire [63:0]       arg_sums,
    output wire [63:0]       arg_steps,
    output wire [31:0]       arg_nseg
);

    // ap_ctrl_hs registers
    localparam [7:0] REG_CTRL = 8'h00;
    localparam [7:0] REG_GIE  = 8'h04;
    localparam [7:0] REG_IER  = 8'h08;
    localparam [7:0] REG_ISR  = 8'h0C;
    localparam [7:0] REG_STATUS = 8'h70;  // read-only, after the arguments
    // the arguments, in the shared order of fpga/ARGS.md (eps_update_<g>_<c>)
    localparam [7:0] ADDR_GR           = 8'h10;  // 64-bit: low word here, high word at +4
    localparam [7:0] ADDR_P            = 8'h18;
    localparam [7:0] ADDR_M            = 8'h20;
    localparam [7:0] ADDR_V            = 8'h28;
    localparam [7:0] ADDR_COPY         = 8'h30;
    localparam [7:0] ADDR_FINITE       = 8'h38;
    localparam [7:0] ADDR_N            = 8'h40;  // 32-bit from here on
    localparam [7:0] ADDR_K            = 8'h44;
    localparam [7:0] ADDR_N_DECAY      = 8'h48;  // the decay boundary (parameter groups)
    localparam [7:0] ADDR_DECAY        = 8'h4C;
    localparam [7:0] ADDR_B1           = 8'h50;
    localparam [7:0] ADDR_OMB1         = 8'h54;
    localparam [7:0] ADDR_B2           = 8'h58;
    localparam [7:0] ADDR_OMB2         = 8'h5C;
    localparam [7:0] ADDR_INV_BC2_SQRT = 8'h60;
    localparam [7:0] ADDR_EPS          = 8'h64;
    localparam [7:0] ADDR_NEG_STEP     = 8'h68;
    localparam [7:0] ADDR_INV_SCALE    = 8'h6C;

    // the LAMB kernel's words (LAMB = 1), past the status register; not ADDR_*: the shared
    // argument order of the three kernel sources is the ADDR_* words
    localparam [7:0] LAMB_ADDR_PASS    = 8'h74;  // 1: norms pass, 2: step pass
    localparam [7:0] LAMB_ADDR_SEG     = 8'h78;  // 64-bit
    localparam [7:0] LAMB_ADDR_SUMS    = 8'h80;  // 64-bit
    localparam [7:0] LAMB_ADDR_STEPS   = 8'h88;  // 64-bit
    localparam [7:0] LAMB_ADDR_NSEG    = 8'h90;

    localparam NWORDS = 24;   // argument words: 6 buffers x 2 + 12 x 1, from 0x10
    localparam XWORDS = 8;    // LAMB's words: 3 buffers x 2 + 2 x 1, from 0x74

    initial begin
        if (ADDR_W < 7 || ADDR_W > 32 || (LAMB != 0 && LAMB != 1) || (LAMB == 1 && ADDR_W < 8)) begin
            $error("l2l_axil_ctrl: illegal ADDR_W=%0d LAMB=%0d (ADDR_W 7 .. 32, 8 .. 32 with LAMB)", ADDR_W, LAMB);
            $finish;
        end
    end

    // ------------------------------------------------------------ registers
    reg        int_ap_start, int_ap_done, int_ap_ready, int_auto_restart;
    reg        int_gie;
    reg [1:0]  int_ier, int_isr;
    reg [31:0] args [0:NWORDS-1];   // word w at 0x10 + 4*w
    reg [31:0] xargs [0:XWORDS-1];  // word w at 0x74 + 4*w (only written when LAMB = 1)

    // ------------------------------------------------------------ write channel
    reg              aw_have, w_have;
    reg [ADDR_W-1:0] aw_addr;
    reg [31:0]       w_data;
    reg [3:0]        w_strb;

    assign s_axi_control_awready = !aw_have && !s_axi_control_bvalid;
    assign s_axi_control_wready  = !w_have && !s_axi_control_bvalid;
    assign s_axi_control_bresp   = 2'b00;

    // both addresses zero-extended to 32 bits
    wire [31:0] aw32, ar32;
    generate
        if (ADDR_W < 32) begin : g_ext
            assign aw32 = {{(32 - ADDR_W){1'b0}}, aw_addr};
            assign ar32 = {{(32 - ADDR_W){1'b0}}, s_axi_control_araddr};
        end else begin : g_full
            assign aw32 = aw_addr;
            assign ar32 = s_axi_control_araddr;
        end
    endgenerate

    wire        do_write = aw_have && w_have;
    wire [7:0]  wa       = aw32[7:0] & 8'hFC;
    wire        wa_high  = (aw32[31:8] != 0);       // beyond the map
    wire [4:0]  wa_word  = wa[6:2] - ADDR_GR[6:2];  // argument word, when wa is in 0x10 .. 0x6F
    wire [2:0]  wa_x     = wa[4:2] - LAMB_ADDR_PASS[4:2];   // LAMB's word, when wa is in 0x74 .. 0x93
    wire        wa_in_x  = (LAMB == 1) && wa >= LAMB_ADDR_PASS && wa < LAMB_ADDR_PASS + 4 * XWORDS;
    wire [31:0] wmask    = {{8{w_strb[3]}}, {8{w_strb[2]}}, {8{w_strb[1]}}, {8{w_strb[0]}}};

    // ------------------------------------------------------------ read channel
    assign s_axi_control_arready = !s_axi_control_rvalid;
    assign s_axi_control_rresp   = 2'b00;
    wire        ar_take = s_axi_control_arvalid && s_axi_control_arready;
    wire [7:0]  ra      = ar32[7:0] & 8'hFC;
    wire        ra_high = (ar32[31:8] != 0);
    wire [4:0]  ra_word = ra[6:2] - ADDR_GR[6:2];
    wire [2:0]  ra_x    = ra[4:2] - LAMB_ADDR_PASS[4:2];
    wire        ra_in_x = (LAMB == 1) && ra >= LAMB_ADDR_PASS && ra < LAMB_ADDR_PASS + 4 * XWORDS;
    wire        read_ctrl = ar_take && !ra_high && (ra == REG_CTRL);

    reg [31:0] rword;
    always @(*) begin
        rword = 32'd0;
        if (!ra_high) begin
            if (ra == REG_CTRL)
                rword = {24'd0, int_auto_restart, 3'd0, int_ap_ready, ap_idle, int_ap_done, int_ap_start};
            else if (ra == REG_GIE)
                rword = {31'd0, int_gie};
            else if (ra == REG_IER)
                rword = {30'd0, int_ier};
            else if (ra == REG_ISR)
                rword = {30'd0, int_isr};
            else if (ra == REG_STATUS)
                rword = {31'd0, dma_error};
            else if (ra >= ADDR_GR && ra < ADDR_GR + 4 * NWORDS)
                rword = args[ra_word];
            else if (ra_in_x)
                rword = xargs[ra_x];
        end
    end

    integer j;
    always @(posedge clk) begin
        if (rst) begin
            aw_have              <= 1'b0;
            w_have               <= 1'b0;
            s_axi_control_bvalid <= 1'b0;
            s_axi_control_rvalid <= 1'b0;
            s_axi_control_rdata  <= 32'd0;
            int_ap_start         <= 1'b0;
            int_ap_done          <= 1'b0;
            int_ap_ready         <= 1'b0;
            int_auto_restart     <= 1'b0;
            int_gie              <= 1'b0;
            int_ier              <= 2'b00;
            int_isr              <= 2'b00;
            for (j = 0; j < NWORDS; j = j + 1)
                args[j] <= 32'd0;
            for (j = 0; j < XWORDS; j = j + 1)
                xargs[j] <= 32'd0;
        end else begin
            // write: address and data in either order, then one response
            if (s_axi_control_awvalid && s_axi_control_awready) begin
                aw_have <= 1'b1;
                aw_addr <= s_axi_control_awaddr;
            end
            if (s_axi_control_wvalid && s_axi_control_wready) begin
                w_have <= 1'b1;
                w_data <= s_axi_control_wdata;
                w_strb <= s_axi_control_wstrb;
            end
            if (do_write) begin
                aw_have              <= 1'b0;
                w_have               <= 1'b0;
                s_axi_control_bvalid <= 1'b1;
            end else if (s_axi_control_bready) begin
                s_axi_control_bvalid <= 1'b0;
            end

            // read: one outstanding
            if (ar_take) begin
                s_axi_control_rvalid <= 1'b1;
                s_axi_control_rdata  <= rword;
            end else if (s_axi_control_rready) begin
                s_axi_control_rvalid <= 1'b0;
            end

            // arguments
            if (do_write && !wa_high && wa >= ADDR_GR && wa < ADDR_GR + 4 * NWORDS)
                args[wa_word] <= (args[wa_word] & ~wmask) | (w_data & wmask);
            if (do_write && !wa_high && wa_in_x)
                xargs[wa_x] <= (xargs[wa_x] & ~wmask) | (w_data & wmask);

            // control: core events take priority over a host clear in the same cycle
            if (ap_ready)
                int_ap_start <= int_auto_restart;
            else if (do_write && !wa_high && wa == REG_CTRL && w_strb[0] && w_data[0])
                int_ap_start <= 1'b1;
            if (do_write && !wa_high && wa == REG_CTRL && w_strb[0])
                int_auto_restart <= w_data[7];

            if (ap_done)
                int_ap_done <= 1'b1;
            else if (read_ctrl)
                int_ap_done <= 1'b0;
            if (ap_ready)
                int_ap_ready <= 1'b1;
            else if (read_ctrl)
                int_ap_ready <= 1'b0;

            if (do_write && !wa_high && wa == REG_GIE && w_strb[0])
                int_gie <= w_data[0];
            if (do_write && !wa_high && wa == REG_IER && w_strb[0])
                int_ier <= w_data[1:0];
            int_isr[0] <= (int_isr[0] ^ (do_write && !wa_high && wa == REG_ISR && w_strb[0] && w_data[0]))
                          | (ap_done && int_ier[0]);
            int_isr[1] <= (int_isr[1] ^ (do_write && !wa_high && wa == REG_ISR && w_strb[0] && w_data[1]))
                          | (ap_ready && int_ier[1]);
        end
    end

    assign interrupt = int_gie && (int_isr != 2'b00);
    assign ap_start  = int_ap_start;

    assign arg_gr              = {args[(ADDR_GR - ADDR_GR) / 4 + 1], args[(ADDR_GR - ADDR_GR) / 4]};
    assign arg_p               = {args[(ADDR_P - ADDR_GR) / 4 + 1], args[(ADDR_P - ADDR_GR) / 4]};
    assign arg_m               = {args[(ADDR_M - ADDR_GR) / 4 + 1], args[(ADDR_M - ADDR_GR) / 4]};
    assign arg_v               = {args[(ADDR_V - ADDR_GR) / 4 + 1], args[(ADDR_V - ADDR_GR) / 4]};
    assign arg_copy            = {args[(ADDR_COPY - ADDR_GR) / 4 + 1], args[(ADDR_COPY - ADDR_GR) / 4]};
    assign arg_finite          = {args[(ADDR_FINITE - ADDR_GR) / 4 + 1], args[(ADDR_FINITE - ADDR_GR) / 4]};
    assign arg_n               = args[(ADDR_N - ADDR_GR) / 4];
    assign arg_k               = args[(ADDR_K - ADDR_GR) / 4];
    assign arg_n_decay         = args[(ADDR_N_DECAY - ADDR_GR) / 4];
    assign arg_decay           = args[(ADDR_DECAY - ADDR_GR) / 4];
    assign arg_b1              = args[(ADDR_B1 - ADDR_GR) / 4];
    assign arg_omb1            = args[(ADDR_OMB1 - ADDR_GR) / 4];
    assign arg_b2              = args[(ADDR_B2 - ADDR_GR) / 4];
    assign arg_omb2            = args[(ADDR_OMB2 - ADDR_GR) / 4];
    assign arg_inv_bc2_sqrt    = args[(ADDR_INV_BC2_SQRT - ADDR_GR) / 4];
    assign arg_eps             = args[(ADDR_EPS - ADDR_GR) / 4];
    assign arg_neg_step        = args[(ADDR_NEG_STEP - ADDR_GR) / 4];
    assign arg_inv_scale       = args[(ADDR_INV_SCALE - ADDR_GR) / 4];
    assign arg_pass            = xargs[(LAMB_ADDR_PASS - LAMB_ADDR_PASS) / 4];
    assign arg_seg             = {xargs[(LAMB_ADDR_SEG - LAMB_ADDR_PASS) / 4 + 1], xargs[(LAMB_ADDR_SEG - LAMB_ADDR_PASS) / 4]};
    assign arg_sums            = {xargs[(LAMB_ADDR_SUMS - LAMB_ADDR_PASS) / 4 + 1], xargs[(LAMB_ADDR_SUMS - LAMB_ADDR_PASS) / 4]};
    assign arg_steps           = {xargs[(LAMB_ADDR_STEPS - LAMB_ADDR_PASS) / 4 + 1], xargs[(LAMB_ADDR_STEPS - LAMB_ADDR_PASS) / 4]};
    assign arg_nseg            = xargs[(LAMB_ADDR_NSEG - LAMB_ADDR_PASS) / 4];

endmodule

`default_nettype wire
