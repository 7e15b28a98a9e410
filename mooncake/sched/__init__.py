"""The conductor's planning side: KV index, cost models, policies, admission."""
