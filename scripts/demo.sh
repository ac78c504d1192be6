#!/usr/bin/env bash
# The main job (`make demo`): the component for real under daprd, on this machine, in ~30 s.
#
# Starts, on private loopback ports in a temp dir: redis-server, `delayed-pubsub serve` (its
# socket in a private socket folder), the subscriber app (examples/subscriber.py, printing each
# arrival with its lateness) and daprd with a component YAML of `type: pubsub.delayed-pubsub`.
# Then publishes with curl, exactly as a user would, a few messages delayed by 2-10 s
# (scheduledSendDelay and scheduledSendTime), a recurring `@every 2s` schedule and a cron one
# (`*/3 * * * * *`), a cron one in New York time limited to 3 fires (scheduleTimeZone,
# scheduleLimit), cancels the first two with curl (scheduleCancel), checks they stopped, waits for
# them, prints a summary and stops everything (also on Ctrl-C or error).
# Exit code 0 only when every delayed message arrived, none before it was due.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

"$root/scripts/setup.sh"
daprd="$("$root/scripts/daprd.sh")"

work="$(mktemp -d "${TMPDIR:-/tmp}/delayed-pubsub-demo.XXXXXX")"
pids=()
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    # Each service runs in its own process group (setsid): stop the groups, daprd first.
    local i pid
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill -TERM -- "-${pids[i]}" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    if ((status != 0)); then
        printf '\nlogs kept in %s\n' "$work" >&2
    else
        rm -rf "$work"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
now_ms() { date +%s%3N; }
wait_for() {  # wait_for SECONDS WHAT PID COMMAND...
    local seconds=$1 what=$2 pid=$3
    shift 3
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        kill -0 "$pid" 2>/dev/null || die "$what: the process exited; see $work"
        ((SECONDS < deadline)) || die "timed out waiting for $what; see $work"
        sleep 0.1
    done
}
start() {  # start NAME LOGFILE COMMAND... : in its own process group, pid into $last_pid
    local name=$1 log=$2
    shift 2
    setsid "$@" >"$log" 2>&1 </dev/null &
    last_pid=$!
    pids+=("$last_pid")
    printf '  %-22s pid %-7s log %s\n' "$name" "$last_pid" "$log"
}

redis_port=$(free_port)
app_port=$(free_port)
http_port=$(free_port)
grpc_port=$(free_port)
sockets="$work/sockets"
mkdir -p "$sockets" "$work/resources" "$work/redis"

say "starting the stack in $work"
start "redis-server :$redis_port" "$work/redis.log" \
    redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$work/redis" --save "" --appendonly no
wait_for 10 "redis-server" "$last_pid" redis-cli -p "$redis_port" ping

# The socket must exist before daprd starts: daprd scans the socket folder once.
start "delayed-pubsub serve" "$work/component.log" \
    "$venv/bin/delayed-pubsub" serve --socket "$sockets/delayed-pubsub.sock"
wait_for 30 "the component's socket" "$last_pid" test -S "$sockets/delayed-pubsub.sock"

cat >"$work/resources/delayed.yaml" <<YAML
apiVersion: dapr.io/v1alpha1
kind: Component
metadata:
  name: delayed
spec:
  type: pubsub.delayed-pubsub
  version: v1
  metadata:
    - name: redisHost
      value: "127.0.0.1:$redis_port"
    - name: enableDelayedMessaging
      value: "true"
    - name: redeliverInterval
      value: "2s"
YAML

# The subscriber prints arrivals to this terminal (its output is the demo's).
setsid "$py" examples/subscriber.py --port "$app_port" --sub delayed=orders --sub delayed=reminders \
    --arrivals "$work/arrivals.jsonl" --print </dev/null 2>"$work/subscriber.log" &
last_pid=$!
pids+=("$last_pid")
printf '  %-22s pid %-7s log %s\n' "subscriber :$app_port" "$last_pid" "$work/subscriber.log"
wait_for 15 "the subscriber" "$last_pid" curl -fsS "http://127.0.0.1:$app_port/healthz"

start "daprd $("$daprd" --version 2>/dev/null || echo)" "$work/daprd.log" \
    env DAPR_COMPONENTS_SOCKETS_FOLDER="$sockets" HOME="$work" "$daprd" \
    --app-id demo-app --app-port "$app_port" --app-protocol http --app-channel-address 127.0.0.1 \
    --resources-path "$work/resources" \
    --dapr-http-port "$http_port" --dapr-grpc-port "$grpc_port" --dapr-listen-addresses 127.0.0.1 \
    --dapr-internal-grpc-port "$(free_port)" --dapr-internal-grpc-listen-address 127.0.0.1 \
    --metrics-port "$(free_port)" --metrics-listen-address 127.0.0.1 --enable-metrics=false \
    --placement-host-address "" --scheduler-host-address "" --log-level warn
wait_for 60 "daprd /v1.0/healthz" "$last_pid" curl -fsS "http://127.0.0.1:$http_port/v1.0/healthz"
daprd_pid=$last_pid
dapr="http://127.0.0.1:$http_port/v1.0"

# --- publish, exactly as a user would with curl ------------------------------------------------
publish() {  # publish TOPIC LABEL DUE_MS QUERY  -> HTTP status
    curl -sS -o "$work/last-response" -w '%{http_code}' -X POST "$dapr/publish/delayed/$1${4:+?$4}" \
        -H 'Content-Type: application/json' -d "{\"label\": \"$2\", \"due_ms\": $3}"
}
error_message() {  # the component's own words from daprd's error body
    "$py" -c 'import json, sys; m = json.load(open(sys.argv[1])).get("message", ""); print(m.split("desc = ")[-1][:200])' \
        "$work/last-response" 2>/dev/null || head -c 200 "$work/last-response"
}
report() {  # report LABEL DELAY_MS HTTP_STATUS: one line; accepted ones are expected to arrive
    if [[ $3 == 2* ]]; then
        printf '  %-28s due +%5d ms  -> %s\n' "$1" "$2" "$3"
        expected+=("$1")
    else
        printf '  %-28s due +%5d ms  -> %s refused: %s\n' "$1" "$2" "$3" \
            "$(error_message)"
        refused=$((refused + 1))
    fi
}
refused=0
rfc3339_in() { date -u -d "@$(($(date +%s) + $1))" +%Y-%m-%dT%H:%M:%SZ; }

say "publishing with curl (what, due in, HTTP status); arrivals print as they come, with lateness = received - due"
expected=()
for spec in "now::0" "delay 2s:scheduledSendDelay=2s:2000" "delay 5s:scheduledSendDelay=5s:5000" \
    "delay 10s:scheduledSendDelay=10s:10000" "delay 3 (seconds):scheduledSendDelay=3:3000"; do
    IFS=: read -r label query delay <<<"$spec"
    t=$(now_ms)  # due = just before the publish: lateness includes curl's round trip
    code=$(publish orders "$label" $((t + delay)) "${query:+metadata.$query}")
    report "$label" "$delay" "$code"
done
at=$(rfc3339_in 7)
at_ms=$(($(date -u -d "$at" +%s) * 1000))
code=$(publish orders "at $at" "$at_ms" "metadata.scheduledSendTime=$at")
report "at $at" $((at_ms - $(now_ms))) "$code"

# --- recurring schedules -------------------------------------------------------------------------
# An `@every 2s` schedule and a cron one (every 3 s, on whole seconds), each with a scheduleId.
# Each fire's `scheduleNext` header names the next due instant, so the summary can tell every
# fire's lateness. Once both have fired a few times the `@every` one is cancelled with curl, the
# cron one keeps firing a little longer (to show only the cancelled one stopped), then it goes too.
schedules=()
schedule_publish() {  # schedule_publish LABEL ID QUERY_VALUE(url-encoded) [MORE_QUERY]
    local code
    code=$(publish reminders "$1" null "metadata.schedule=$3&metadata.scheduleId=$2${4:-}")
    if [[ $code == 2* ]]; then
        schedules+=("$1")
        printf '  %-28s id %-14s -> %s\n' "schedule $1" "$2" "$code"
    else
        printf '  %-28s id %-14s -> %s refused: %s\n' "schedule $1" "$2" "$code" "$(error_message)"
        refused=$((refused + 1))
    fi
}
schedule_publish "every 2s" demo-every "@every%202s"
schedule_publish "cron */3" demo-cron "*/3%20*%20*%20*%20*%20*"
# Every 2 s on New York's wall clock, three times, then removed by itself (history: completed).
schedule_publish "new york x3" demo-zoned "*/2%20*%20*%20*%20*%20*" \
    "&metadata.scheduleTimeZone=America/New_York&metadata.scheduleLimit=3"

fires_of() {  # fires_of LABEL: successful arrivals of that label so far
    "$py" - "$work/arrivals.jsonl" "$1" <<'PY' 2>/dev/null || echo 0
import json, sys
print(sum(1 for l in open(sys.argv[1]) if json.loads(l)["status"] == 200 and json.loads(l)["data"].get("label") == sys.argv[2]))
PY
}

say "waiting for the arrivals (at most 20 s)"
deadline=$((SECONDS + 20))
while ((SECONDS < deadline)); do
    kill -0 "$daprd_pid" 2>/dev/null || die "daprd exited; see $work/daprd.log"
    # Everything one-shot arrived, and each schedule fired at least three times.
    enough=1
    for label in "${schedules[@]}"; do
        (( $(fires_of "$label") >= 3 )) || enough=0
    done
    if ((enough)) && "$py" - "$work/arrivals.jsonl" "${expected[@]}" <<'PY'
import json, sys
seen = {json.loads(l)["data"].get("label") for l in open(sys.argv[1])}
sys.exit(0 if set(sys.argv[2:]) <= seen else 1)
PY
    then
        break
    fi
    sleep 0.2
done

cancel_schedule() {  # cancel_schedule ID: prints the HTTP status and the time (ms) it returned
    local code
    code=$(curl -sS -o /dev/null -w '%{http_code}' -X POST \
        "$dapr/publish/delayed/reminders?metadata.scheduleId=$1&metadata.scheduleCancel=true" \
        -H 'Content-Type: application/json' -d '{}')
    printf '  schedule %-14s cancelled with curl -> %s\n' "$1" "$code"
    [[ $code == 2* ]] || refused=$((refused + 1))
}
cancelled_every_ms=0
cancelled_cron_ms=0
if [[ " ${schedules[*]} " == *" every 2s "* ]]; then
    say "cancelling demo-every; demo-cron goes on for 5 s more"
    cancel_schedule demo-every
    cancelled_every_ms=$(now_ms)
    sleep 5
fi
if [[ " ${schedules[*]} " == *" cron */3 "* ]]; then
    cancel_schedule demo-cron
    cancelled_cron_ms=$(now_ms)
    sleep 2
fi
sleep 0.5

say "summary"
((refused == 0)) || say "$refused delayed publish(es) refused by the component (see above)"
summary_status=0
"$py" - "$work/arrivals.jsonl" "$refused" "$cancelled_every_ms" "$cancelled_cron_ms" "${#schedules[@]}" \
    "${expected[@]}" <<'PY' || summary_status=$?
import json
import statistics
import sys
from datetime import datetime

path, refused = sys.argv[1], int(sys.argv[2])
cancelled = {"every 2s": int(sys.argv[3]), "cron */3": int(sys.argv[4])}
n_schedules, expected = int(sys.argv[5]), sys.argv[6:]
try:
    arrivals = [json.loads(line) for line in open(path)]
except FileNotFoundError:
    arrivals = []
ok = [a for a in arrivals if a["status"] == 200]
by_label = {}
for a in ok:
    by_label.setdefault(a["data"].get("label"), []).append(a)

failed = refused > 0
delayed = [label for label in expected if label != "now"]
lateness = []
for label in expected:
    got = by_label.get(label, [])
    if not got:
        print(f"  MISSING  {label}")
        failed = True
        continue
    late = got[0]["received_ms"] - got[0]["data"]["due_ms"]
    if label in delayed:
        lateness.append(late)
    verdict = "EARLY" if late < 0 else "ok"
    failed |= late < 0
    print(f"  {verdict:<7}  {label:<28} lateness {late:+6d} ms")
if lateness:
    print(
        f"  delayed messages: {len(lateness)} arrived, lateness min {min(lateness)} / "
        f"median {statistics.median(lateness):g} / max {max(lateness)} ms"
    )


def header(arrival, key):
    return next((v for k, v in arrival["headers"].items() if k.lower() == key.lower()), None)


def instant_ms(text):
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


# The zoned schedule with a limit: exactly three fires, the last naming no next one (purge).
zoned = by_label.get("new york x3", [])
if n_schedules:
    nexts = [header(f, "scheduleNext") for f in zoned]
    bad = len(zoned) != 3 or nexts[-1:] != ["purge"]
    failed |= bad
    print(f"  {'ok' if not bad else 'FAILED':<7}  schedule {'new york x3':<19} fired {len(zoned)} times (limit 3), "
          f"scheduleNext {nexts}")

# Each fire names the next due instant (scheduleNext): its own due time is one interval before.
for label, interval in (("every 2s", 2000), ("cron */3", 3000)):
    fires = by_label.get(label, [])
    if not n_schedules:
        break
    if cancelled[label] == 0 and not fires:
        continue  # refused at publish (counted above)
    late = []
    for fire in fires:
        nxt = header(fire, "scheduleNext")
        if nxt is None or nxt == "purge":
            late.append(None)
            continue
        late.append(fire["received_ms"] - (instant_ms(nxt) - interval))
    # A fire already on its way when the cancel returned may land just after it; nothing later.
    after = [f for f in fires if cancelled[label] and f["received_ms"] > cancelled[label] + 1500]
    bad = len(fires) < 3 or any(x is None or x < 0 for x in late) or bool(after)
    failed |= bad
    shown = ", ".join("?" if x is None else f"{x:+d}" for x in late)
    print(f"  {'ok' if not bad else 'FAILED':<7}  schedule {label:<19} fired {len(fires)} times, lateness [{shown}] ms")
    if after:
        print(f"           {len(after)} fire(s) after it was cancelled")
print("  result:", "FAILED" if failed else "all delayed messages on time")
sys.exit(1 if failed else 0)
PY

# --- analytics: `delayed-pubsub stats` (Spark) on what the demo published -----------------------
# A spread of messages still waiting (due over the next hour, not part of the arrivals above), then
# the Spark job reads the delayed topic and the lifecycle history of the demo app.
say "publishing 80 messages due over the next hour (they stay pending), then: delayed-pubsub stats"
for i in $(seq 1 40); do  # reminders evenly every 90 s, orders denser soon (i^2 * 2.25 s)
    for spec in "reminders:$((i * 90))" "orders:$((i * i * 9 / 4))"; do
        IFS=: read -r topic delay_s <<<"$spec"
        code=$(publish "$topic" "later $i" $(($(now_ms) + delay_s * 1000)) "metadata.scheduledSendDelay=${delay_s}s")
        [[ $code == 2* ]] || die "publishing 'later $i' on $topic failed with HTTP $code: $(error_message)"
    done
done
stats_out="${DEMO_STATS_OUT:-${TMPDIR:-/tmp}/delayed-pubsub-demo-stats}"
"$venv/bin/delayed-pubsub" stats --redis-host "127.0.0.1:$redis_port" --app-id demo-app --out "$stats_out" ||
    die "delayed-pubsub stats failed"
say "stats tables (Parquet) and charts (PNG) kept in $stats_out"
exit "$summary_status"
