package testenv

import (
	"bytes"
	"sync"
)

// logTail is how much of a log String keeps: the end, where a failure shows.
const logTail = 20000

// LogBuffer collects a log written from several goroutines (a child process's output, a
// client's slog handler), for showing when a test fails.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String is the log's last 20,000 bytes.
func (b *LogBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.buf.String()
	if len(s) > logTail {
		s = s[len(s)-logTail:]
	}
	return s
}
