"""Documents in a chat: text, Markdown, code, CSV and PDF files read into text (`extract`), cut into
overlapping chunks (`chunks`), kept in the chat database with an FTS5 index and retrieved by BM25
(`index`), and put into the prompt with numbered sources the reply cites (`prompt`). No Qt and no MLX
in these modules; `worker` runs an extraction in a child process (bounded time and memory, Cancel),
`attach` is the chat tab's Qt side (the Attach button, drops, progress, the passage a citation shows)."""
