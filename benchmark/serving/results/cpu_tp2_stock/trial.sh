#!/bin/bash
# Under the lock: TP2 then TP1 server, each queried, each process group killed.
cd /tmp/wt-tp
for tp in 2 1; do
  port=$((31710 + tp))
  setsid /tmp/wt-tp/serve.sh $port $tp /tmp/wt-tp/tp$tp.log &
  spid=$!
  timeout 450 /work/main/.venv/bin/python /tmp/wt-tp/client.py $port /tmp/wt-tp/out_tp$tp.json > /tmp/wt-tp/client_tp$tp.txt 2>&1
  echo "client tp$tp rc=$?" >> /tmp/wt-tp/client_tp$tp.txt
  kill -TERM -- -$spid 2>/dev/null; sleep 3; kill -KILL -- -$spid 2>/dev/null
  [ -s /tmp/wt-tp/out_tp2.json ] || break
done
