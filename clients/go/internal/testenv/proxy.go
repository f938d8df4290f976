package testenv

import (
	"net"
	"sync"
	"testing"
)

// Proxy is a TCP proxy between a client and the coordinator that can lose the coordinator's
// answers (requests still reach it) and then cut every connection, as a network failure would,
// or refuse connections altogether.
type Proxy struct {
	Addr string

	listener net.Listener
	target   string
	mu       sync.Mutex
	conns    map[net.Conn]bool
	withhold bool
	refuse   bool
	wg       sync.WaitGroup
}

// StartProxy proxies to target until the test ends.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Addr: l.Addr().String(), listener: l, target: target, conns: map[net.Conn]bool{}}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = l.Close()
		p.cut()
		p.wg.Wait()
	})
	return p
}

func (p *Proxy) accept() {
	for {
		client, err := p.listener.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.refuse
		p.mu.Unlock()
		if refuse {
			_ = client.Close()
			continue
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		p.conns[client], p.conns[server] = true, true
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(server, client, false) })
		p.wg.Go(func() { p.pipe(client, server, true) })
	}
}

// pipe copies from src to dst; answers (fromServer) are dropped while withholding.
func (p *Proxy) pipe(dst, src net.Conn, fromServer bool) {
	defer func() {
		_ = dst.Close()
		_ = src.Close()
		p.mu.Lock()
		delete(p.conns, dst)
		delete(p.conns, src)
		p.mu.Unlock()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			drop := fromServer && p.withhold
			p.mu.Unlock()
			if !drop {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// WithholdAnswers loses the coordinator's answers from now on; requests still reach it.
func (p *Proxy) WithholdAnswers() {
	p.mu.Lock()
	p.withhold = true
	p.mu.Unlock()
}

// CutAndRestore cuts every open connection (so no torn frame is ever delivered) and lets new
// ones through in both directions.
func (p *Proxy) CutAndRestore() {
	p.cut()
	p.mu.Lock()
	p.withhold = false
	p.refuse = false
	p.mu.Unlock()
}

// Refuse cuts every connection and refuses new ones until CutAndRestore: the coordinator is
// unreachable.
func (p *Proxy) Refuse() {
	p.mu.Lock()
	p.refuse = true
	p.mu.Unlock()
	p.cut()
}

func (p *Proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}
