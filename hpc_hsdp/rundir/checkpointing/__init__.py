"""The checkpoints as files: state (the checkpoints' state, read without torch), checkpoint_store
(--checkpoint-store: its URL, layout, commit, retention and resume rules), store_record
(checkpoint_store.json: the uploads' state)."""
