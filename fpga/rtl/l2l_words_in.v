// l2l_words_in -- 32-bit words out of an AXI-Stream of LANES elements of EW
// bits a beat: the LAMB kernel's segment bounds and step sizes, read on a
// port whose elements may be 16 bits wide.
//
// What: the beats of one l2l_axi_rd command (tkeep contiguous from lane 0, as
// that engine gives them) are taken apart one element per clock. EW = 32: each
// element is a word. EW = 16: two elements make a word, the first its low half
// (the words are little-endian in memory, so a 32-bit word read as two 16-bit
// elements comes back low half first). `clear` (a run starts) forgets a half
// word and the position in the beat.
//
// Why: the LAMB kernel reads its small per-segment arrays on ports that are
// idle in that pass (gr's, copy's), whose element width is the gradient's or
// the copy's. One word per clock at EW = 32, one per two at EW = 16: the
// consumers take one word per segment, and segments are many elements long.
//
// Flow control: m_valid is s_tvalid (and, at EW = 16, a low half held);
// s_tready is high only on the clock the beat's last element is taken, so it
// is combinational from m_ready (one AND; no loop: m_ready never depends on
// s_tready).
`default_nettype none

module l2l_words_in #(
    parameter LANES = 1,    // elements per beat, 1 .. 16
    parameter EW    = 32    // element bits: 32 or 16
) (
    input  wire                clk,
    input  wire                rst,
    input  wire                clear,
    input  wire [EW*LANES-1:0] s_tdata,
    input  wire [LANES-1:0]    s_tkeep,
    input  wire                s_tvalid,
    output wire                s_tready,
    output wire [31:0]         m_word,
    output wire                m_valid,
    input  wire                m_ready
);

    initial begin
        if (LANES < 1 || LANES > 16 || (EW != 32 && EW != 16)) begin
            $error("l2l_words_in: illegal LANES=%0d EW=%0d (LANES 1 .. 16, EW 16 or 32)", LANES, EW);
            $finish;
        end
    end

    reg  [4:0]       idx;                 // the element of the beat taken next
    wire [31:0]      keep_ext = {{(32 - LANES){1'b0}}, s_tkeep};
    wire             last_el  = ({27'd0, idx} == LANES - 1) || !keep_ext[idx + 5'd1];
    wire [EW-1:0]    el       = s_tdata[EW * idx +: EW];
    wire             el_take;

    generate
        if (EW == 32) begin : g_word
            assign m_word  = el;
            assign m_valid = s_tvalid;
            assign el_take = s_tvalid && m_ready;
        end else begin : g_halves
            reg        have_lo;
            reg [15:0] lo;
            assign m_word  = {el, lo};
            assign m_valid = s_tvalid && have_lo;
            assign el_take = s_tvalid && (!have_lo || m_ready);
            always @(posedge clk) begin
                if (rst || clear) begin
                    have_lo <= 1'b0;
                    lo      <= 16'd0;
                end else if (el_take) begin
                    have_lo <= !have_lo;
                    if (!have_lo)
                        lo <= el;
                end
            end
        end
    endgenerate

    assign s_tready = el_take && last_el;

    always @(posedge clk) begin
        if (rst || clear)
            idx <= 5'd0;
        else if (el_take)
            idx <= last_el ? 5'd0 : idx + 5'd1;
    end

endmodule

`default_nettype wire
