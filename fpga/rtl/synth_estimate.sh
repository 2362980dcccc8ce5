#!/usr/bin/env bash
# synth_estimate.sh -- yosys area estimate of an RTL EPS module (default: the
# AdamW datapath l2l_eps_adamw at LANES=1): cells, LUTs, flip-flops, shift
# registers, DSPs, block RAM.
#
#   fpga/rtl/synth_estimate.sh [TOP] [PARAM=VALUE ...]
#   fpga/rtl/synth_estimate.sh                                  # l2l_eps_adamw LANES=1 CDTYPE=0
#   fpga/rtl/synth_estimate.sh l2l_eps_adamw LANES=1 CDTYPE=1
#   fpga/rtl/synth_estimate.sh l2l_eps_reduce LANES=1 GDTYPE=1 BLOCK=64
#   fpga/rtl/synth_estimate.sh l2l_eps_adamw LANES=1 CDTYPE=0 DSP_SHAPE=1   # 27x18 multipliers
#   FAMILY=xcup fpga/rtl/synth_estimate.sh                      # UltraScale+ primitives
#   SYNTH=generic fpga/rtl/synth_estimate.sh                    # technology-independent synth
#
# SYNTH=xilinx (default) runs synth_xilinx (7-series primitives: LUT1..6,
# FDRE/FDSE, SRL16E/SRLC32E, CARRY4, DSP48E1, RAMB18/36); with FAMILY=xcup
# (or xcu) it runs `synth_xilinx -family xcup`: UltraScale+ primitives
# (CARRY8, DSP48E2). SYNTH=generic runs yosys' generic `synth` (gates and
# $_DFF_ cells, no LUT/DSP mapping).
# The files are found from the top module by following l2l_* instantiations
# (one module per file, named after it). The full yosys log goes to
# $LOG (default: a temporary file); the summary is printed on stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
top="${1:-l2l_eps_adamw}"
[ $# -gt 0 ] && shift
params=("$@")
if [ ${#params[@]} -eq 0 ] && [ "$top" = l2l_eps_adamw ]; then params=(LANES=1 CDTYPE=0); fi
synth="${SYNTH:-xilinx}"
family="${FAMILY:-xc7}"
command -v yosys >/dev/null || { echo "yosys not found: apt-get install yosys (make rtl-tools)" >&2; exit 1; }

# the module's file and, transitively, those of the l2l_* modules it instantiates
files=()
todo=("$top")
declare -A seen=()
while [ ${#todo[@]} -gt 0 ]; do
    m="${todo[0]}"; todo=("${todo[@]:1}")
    [ -n "${seen[$m]:-}" ] && continue
    seen[$m]=1
    f="$here/$m.v"
    [ -f "$f" ] || { echo "synth_estimate: $m.v not found in $here" >&2; exit 1; }
    files+=("$f")
    for dep in $(sed -e 's://.*$::' "$f" | grep -oE '^\s*l2l_[a-z0-9_]+\s*(#|[a-zA-Z_][a-zA-Z0-9_]*\s*\()' \
                 | grep -oE 'l2l_[a-z0-9_]+' | sort -u); do
        [ "$dep" != "$m" ] && todo+=("$dep")
    done
done

chparam=""
for p in "${params[@]}"; do chparam+=" -set ${p%%=*} ${p#*=}"; done
case "$synth" in
    xilinx)  synth_cmd="synth_xilinx -top $top -flatten"
             [ "$family" != xc7 ] && synth_cmd="synth_xilinx -family $family -top $top -flatten" ;;
    generic) synth_cmd="synth -top $top -flatten" ;;
    *) echo "SYNTH=$synth: use xilinx or generic" >&2; exit 1 ;;
esac

log="${LOG:-$(mktemp -t l2l_synth.XXXXXX.log)}"
stat_file="$(mktemp -t l2l_stat.XXXXXX.txt)"
trap 'rm -f "$stat_file"' EXIT
script="read_verilog -I $here ${files[*]};"
[ -n "$chparam" ] && script+=" chparam$chparam $top;"
script+=" $synth_cmd; tee -q -o $stat_file stat"

start=$(date +%s)
yosys -q -l "$log" -p "$script" >/dev/null
secs=$(( $(date +%s) - start ))

echo "yosys $(yosys -V | awk '{print $2}') $synth_cmd: $top ${params[*]} (${#files[@]} files, ${secs}s; log $log)"
case "$family" in xcup|xcu) dsp_name=DSP48E2 carry_name=CARRY8 ;; *) dsp_name=DSP48E1 carry_name=CARRY4 ;; esac
awk -v synth="$synth" -v dsp_name="$dsp_name" -v carry_name="$carry_name" '
    /Number of cells:/ { cells = $NF; incells = 1; next }
    incells && NF == 2 && $1 !~ /:/ {
        n = $2; c = $1
        if (c ~ /^LUT[1-6]$/) lut += n
        else if (c ~ /^FD/ || c ~ /^\$_DFF/ || c ~ /^\$_SDFF/ || c ~ /^\$_DFFE/ || c ~ /^\$_SDFFE/ || c ~ /^\$_SDFFCE/) ff += n
        else if (c ~ /^SRL/) srl += n
        else if (c ~ /^DSP/) dsp += n
        else if (c ~ /^RAMB/) bram += n
        else if (c ~ /^RAM[0-9]/) lutram += n
        else if (c ~ /^CARRY/) carry += n
        else if (c ~ /^MUXF/) muxf += n
        per[c] = n
    }
    END {
        printf "cells        %d\n", cells
        if (synth == "xilinx") {
            printf "LUT          %d  (LUT1..LUT6)\n", lut
            printf "FF           %d\n", ff
            printf "SRL          %d  (shift-register LUTs: the delay lines)\n", srl
            printf "%-12s %d\n", dsp_name, dsp
            printf "%-12s %d\n", carry_name, carry
            printf "MUXF7/8      %d\n", muxf
            printf "BRAM         %d  (RAMB18/36)   LUTRAM %d\n", bram, lutram
        } else {
            printf "FF           %d\n", ff
            printf "(generic synth: no LUT/DSP mapping; per-cell counts in the log)\n"
        }
    }' "$stat_file"
lcs=$(grep -oE 'Estimated number of LCs: *[0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$' || true)
[ -n "$lcs" ] && echo "LCs (est.)   $lcs  (yosys' estimate of 7-series logic cells)"
exit 0
