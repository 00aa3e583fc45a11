"""What other frameworks' configs need to load: cosmos-rl's side effects and stale keys
(`cosmos`), and its `--wfm-mode` world-model schema (`wfm`)."""
