#!/usr/bin/env bash
# A seeded random fault campaign for a while: new random seeds one after
# another, each a random workload under a random schedule of faults, checked
# once quiet (tests/faults/campaign/).
#
#   scripts/campaign.sh        # 60 minutes
#   scripts/campaign.sh 15     # 15 minutes (no seed starts after that)
#
# FLASHSALE_CAMPAIGN_SECS sets each seed's busy part (default 60 s here).
# Services as scripts/test.sh starts them; the fault suite's binary is built
# once. Each seed's output goes to .run/campaign/seed-<seed>.log and the report,
# with every violation, its seed and the one command that replays it, to
# .run/campaign/report.md. Exits non-zero when a seed found a violation.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

minutes="${1:-60}"
[[ "$minutes" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [minutes]" >&2; exit 2; }
secs="${FLASHSALE_CAMPAIGN_SECS:-60}"
[[ "$secs" =~ ^[1-9][0-9]*$ ]] || { echo "FLASHSALE_CAMPAIGN_SECS: a number of seconds" >&2; exit 2; }

scripts/services.sh
scripts/redis-cluster.sh start

out="$PWD/.run/campaign"
mkdir -p "$out"
rm -f "$out"/seed-*.log
# Built once; every seed runs the same binary.
# CARGO may wrap cargo (a lock on a shared build machine): `CARGO="flock L cargo"`.
read -r -a cargo <<<"${CARGO:-cargo}"
bin=$("${cargo[@]}" test --locked --test faults --no-run --message-format=json \
    | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
[[ -x "$bin" ]] || { echo "campaign: the fault suite's binary was not built" >&2; exit 1; }

replay() {
    echo "FLASHSALE_CAMPAIGN_SEEDS=$1 FLASHSALE_CAMPAIGN_SECS=$secs cargo test --locked --test faults -- campaign"
}

started=$(date -u +%FT%TZ)
end=$(( $(date +%s) + minutes * 60 ))
seeds=() failed=()
while (( $(date +%s) < end )); do
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    seeds+=("$seed")
    log="$out/seed-$seed.log"
    echo "campaign: seed $seed (replay: $(replay "$seed"))"
    if FLASHSALE_CAMPAIGN_SEEDS="$seed" FLASHSALE_CAMPAIGN_SECS="$secs" "$bin" campaign >"$log" 2>&1; then
        echo "campaign: seed $seed held"
    else
        failed+=("$seed")
        echo "campaign: seed $seed FAILED:"
        grep -E '^campaign-(violation|error) ' "$log" | cut -c1-400 || tail -5 "$log"
    fi
done

report="$out/report.md"
{
    echo "# Fault campaign report"
    echo
    echo "Started $started, ran ${minutes} min, ${secs} s of faults per seed."
    echo "Seeds run: ${#seeds[@]}; with violations: ${#failed[@]}."
    echo
    echo "| seed | result |"
    echo "| ---: | --- |"
    for s in "${seeds[@]}"; do
        if [[ " ${failed[*]} " == *" $s "* ]]; then echo "| $s | FAILED |"; else echo "| $s | held |"; fi
    done
    echo
    echo "## Faults by kind"
    echo
    echo "| fault | times |"
    echo "| --- | ---: |"
    # From each seed's plan line: `campaign: seed S: … ; faults: kind ×n, kind ×n`.
    cat "$out"/seed-*.log 2>/dev/null \
        | sed -n 's/^campaign: seed [0-9]*: .* ; faults: //p' \
        | tr ',' '\n' | sed 's/^ *//' | grep '×' \
        | awk -F' ×' '{ n[$1] += $2 } END { for (k in n) printf "| %s | %d |\n", k, n[k] }' | sort
    echo
    echo "## Violations"
    echo
    if [[ ${#failed[@]} -eq 0 ]]; then
        echo "None: every invariant and every availability bound held."
    fi
    for s in "${failed[@]}"; do
        echo "### seed $s"
        echo
        echo "Replay: \`$(replay "$s")\`"
        echo
        echo "Log: \`.run/campaign/seed-$s.log\`"
        echo
        grep -E '^campaign-(violation|error) ' "$out/seed-$s.log" | sed 's/^/- /' \
            || echo "- (no verdict line; the log's end:) $(tail -3 "$out/seed-$s.log" | tr '\n' ' ')"
        echo
    done
} >"$report"
echo "campaign: ${#seeds[@]} seeds, ${#failed[@]} with violations; report in .run/campaign/report.md"
[[ ${#failed[@]} -eq 0 ]]
