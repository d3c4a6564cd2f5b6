"""Writes a 1.2 MB agent conversation (about 1,000 messages of prose) as one chat
request: what a hop adds to a large body that is sent again and again.
Used by benches/load.sh and benches/instructions.sh.

    python3 benches/conversation.py OUT.json
"""
import json
import random
import sys

random.seed(1)
words = "the a file path line error test build module function return value".split()
messages = [{"role": "system", "content": "You are a coding agent."}]
while len(json.dumps(messages)) < 1_200_000:
    n = len(messages)
    role = "user" if n % 2 else "assistant"
    messages.append({"role": role, "content": f"step {n}: " + " ".join(random.choice(words) for _ in range(200))})
with open(sys.argv[1], "w") as out:
    out.write(json.dumps({"model": "gpt-4o", "messages": messages}))
