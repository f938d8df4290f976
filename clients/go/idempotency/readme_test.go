package idempotency_test

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// The module's README (clients/go/README.md), read from this package's folder.
var readmePath = filepath.Join("..", "README.md")

// readmeBlock is one fenced code block of the README: its language, its lines, and the paragraph
// just before it (which names where a Go snippet comes from).
type readmeBlock struct {
	lang   string
	line   int // of the opening fence, for messages
	lines  []string
	before string
}

func readmeBlocks(t *testing.T) []readmeBlock {
	t.Helper()
	file, err := os.Open(readmePath)
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	var blocks []readmeBlock
	var paragraph, last []string // the paragraph being read, and the one before the blank line
	var open *readmeBlock
	scanner := bufio.NewScanner(file)
	for n := 1; scanner.Scan(); n++ {
		line := scanner.Text()
		switch {
		case open != nil && line == "```":
			blocks = append(blocks, *open)
			open, paragraph, last = nil, nil, nil
		case open != nil:
			open.lines = append(open.lines, line)
		case strings.HasPrefix(line, "```"):
			if paragraph == nil {
				paragraph = last
			}
			open = &readmeBlock{lang: strings.TrimPrefix(line, "```"), line: n, before: strings.Join(paragraph, " ")}
		case strings.TrimSpace(line) == "":
			if paragraph != nil {
				last, paragraph = paragraph, nil
			}
		default:
			paragraph = append(paragraph, line)
		}
	}
	if err := scanner.Err(); err != nil {
		t.Fatal(err)
	}
	if open != nil {
		t.Fatalf("README.md: the block at line %d is never closed", open.line)
	}
	return blocks
}

var (
	sourceLink  = regexp.MustCompile(`\]\(([^)]+\.go)\)`)
	exampleName = regexp.MustCompile("`(Example[A-Za-z0-9_]*)`")
)

// Every Go snippet of the README is, line for line, in the source the paragraph before it names
// (a link to a .go file), and within the Example it names, if any, so that the snippets are
// compiled, and the examples run, by this suite and cannot drift from the code. Indentation is
// not compared (the README's snippets start at the margin), and a declaration may be shown
// without its body's opening brace.
func TestTheREADMESnippetsAreInTheSources(t *testing.T) {
	checked := 0
	for _, block := range readmeBlocks(t) {
		if block.lang != "go" {
			continue
		}
		checked++
		link := sourceLink.FindStringSubmatch(block.before)
		if link == nil {
			t.Errorf("README.md:%d: the paragraph before this Go snippet names no .go file that holds it", block.line)
			continue
		}
		source, err := os.ReadFile(filepath.Join(filepath.Dir(readmePath), link[1]))
		if err != nil {
			t.Errorf("README.md:%d: %v", block.line, err)
			continue
		}
		text := string(source)
		where := link[1]
		if name := exampleName.FindStringSubmatch(block.before); name != nil {
			begin := strings.Index(text, "\nfunc "+name[1]+"() {\n")
			if begin < 0 {
				t.Errorf("README.md:%d: %s holds no func %s", block.line, link[1], name[1])
				continue
			}
			text = text[begin+1:]
			if end := strings.Index(text, "\n}\n"); end >= 0 {
				text = text[:end]
			}
			where = name[1] + " in " + link[1]
		}
		if !containsLines(strings.Split(text, "\n"), block.lines) {
			t.Errorf("README.md:%d: the snippet is not, line for line, in %s:\n%s", block.line, where, strings.Join(block.lines, "\n"))
		}
	}
	if checked == 0 {
		t.Fatal("README.md holds no Go snippet: the test reads the wrong file")
	}
}

// containsLines reports whether snippet's lines appear in source's, one after the other, each
// compared without its indentation; the snippet's last line may leave out a trailing " {".
func containsLines(source, snippet []string) bool {
	for start := 0; start+len(snippet) <= len(source); start++ {
		matched := true
		for i, want := range snippet {
			got, want := strings.TrimSpace(source[start+i]), strings.TrimSpace(want)
			if got != want && (i != len(snippet)-1 || got != want+" {") {
				matched = false
				break
			}
		}
		if matched {
			return true
		}
	}
	return false
}

// The README's install route, as pasted: a service laid out beside a checkout of the repository
// (../idempotency-coordinator), whose go.mod holds the README's require and replace lines, imports
// both packages, and the go command resolves them to this folder. Offline (GOPROXY=off): the
// module's own go.sum and the module cache, which the suite's own build filled, are enough.
func TestTheREADMEInstallRouteResolves(t *testing.T) {
	var directives []string
	for _, block := range readmeBlocks(t) {
		if block.lang == "" && len(block.lines) > 0 && strings.Contains(strings.Join(block.lines, "\n"), "\nreplace ") {
			directives = block.lines
			break
		}
	}
	if directives == nil {
		t.Fatal("README.md holds no block with the require and replace directives")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	dir := t.TempDir()
	if err := os.Symlink(testenv.RepoRoot(), filepath.Join(dir, "idempotency-coordinator")); err != nil {
		t.Fatal(err)
	}
	service := filepath.Join(dir, "service")
	goSum, err := os.ReadFile(filepath.Join("..", "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{
		"go.mod": "module example.com/service\n\ngo 1.26\n\n" + strings.Join(directives, "\n") + "\n",
		"go.sum": string(goSum),
		"main.go": `package main

import (
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotencyhttp"
)

func main() {
	client, _ := idempotency.New("127.0.0.1:50051")
	_, _ = idempotencyhttp.New(client, "orders")
}
`,
	} {
		if err := os.MkdirAll(service, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(service, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	list := exec.Command(goTool, "list", "-mod=mod", "-deps", "-f", "{{.ImportPath}} {{.Dir}}", ".")
	list.Dir = service
	list.Env = append(os.Environ(), "GOPROXY=off", "GOWORK=off", "GOFLAGS=")
	out, err := list.CombinedOutput()
	if err != nil {
		t.Fatalf("go list in a service with the README's go.mod lines: %v\n%s", err, out)
	}
	here, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	want := "github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency " +
		filepath.Join(dir, "idempotency-coordinator", "clients", "go", "idempotency")
	if !strings.Contains(string(out), want+"\n") {
		t.Fatalf("the client did not resolve to the checkout (%s, through the link); go list says:\n%s", here, out)
	}
}
