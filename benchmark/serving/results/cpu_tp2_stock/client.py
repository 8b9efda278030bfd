import json, sys, time, urllib.request
port, out = int(sys.argv[1]), sys.argv[2]
base = f"http://127.0.0.1:{port}"
t0 = time.time()
while True:
    try:
        urllib.request.urlopen(base + "/health_generate", timeout=30).read(); break
    except Exception as e:
        if time.time() - t0 > 420: print("not healthy", e); sys.exit(1)
        time.sleep(3)
print("healthy after", round(time.time() - t0), "s")
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Explain why the sky is blue."]
res = []
for p in prompts:
    body = json.dumps({"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}).encode()
    t = time.time()
    r = json.loads(urllib.request.urlopen(urllib.request.Request(base + "/generate", body, {"Content-Type": "application/json"}), timeout=300).read())
    res.append({"prompt": p, "text": r["text"], "ids": r.get("output_ids"), "s": round(time.time() - t, 2)})
    print(round(time.time() - t, 2), repr(r["text"][:80]))
info = json.loads(urllib.request.urlopen(base + "/get_server_info", timeout=30).read())
res.append({"max_total_num_tokens": info.get("max_total_num_tokens"), "tp_size": info.get("tp_size")})
json.dump(res, open(out, "w"), indent=1)
