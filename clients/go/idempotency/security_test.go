package idempotency_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// newToken makes a token with the binary's own `token new`: the token and its tokens-file line.
func newToken(t *testing.T, name, scopes string) (token, line string) {
	t.Helper()
	out, err := exec.Command(testenv.CoordinatorBinary(), "token", "new", "--name", name, "--scopes", scopes).Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(out), "\n") {
		switch {
		case strings.HasPrefix(l, "idc_"):
			token = l
		case strings.HasPrefix(l, name+" "):
			line = l
		}
	}
	if token == "" || line == "" {
		t.Fatalf("unexpected output of token new:\n%s", out)
	}
	return token, line
}

func TestBearerTokensAndScopes(t *testing.T) {
	token, line := newToken(t, "payments-svc", "payments")
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte(line+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	coordinator := testenv.Start(t, testenv.SQLite, "--tokens-file", tokens)
	ctx := context.Background()
	work := func(context.Context, *idempotency.Lease) (int, error) { return 1, nil }

	anonymous := testenv.NewClient(t, coordinator.Addr)
	if _, err := idempotency.RunOnce(ctx, anonymous, "payments", "k", nil, work); !errors.Is(err, idempotency.ErrUnauthenticated) {
		t.Fatalf("no token: %v", err)
	}
	c := testenv.NewClient(t, coordinator.Addr, idempotency.WithToken(token))
	if _, err := idempotency.RunOnce(ctx, c, "billing", "k", nil, work); !errors.Is(err, idempotency.ErrPermissionDenied) {
		t.Fatalf("another namespace: %v", err)
	}
	if out, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, work); err != nil || out.Value != 1 {
		t.Fatalf("%+v, %v", out, err)
	}
}

// pki is a CA with a server certificate for 127.0.0.1 and a client certificate, in PEM.
type pki struct{ caPEM, serverCert, serverKey, clientCert, clientKey []byte }

func newPKI(t *testing.T) pki {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTemplate := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTemplate, caTemplate, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	leaf := func(serial int64, usage x509.ExtKeyUsage, ips []net.IP) (certPEM, keyPEM []byte) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		template := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "leaf"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: ips,
			DNSNames: []string{"localhost"},
		}
		der, err := x509.CreateCertificate(rand.Reader, template, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	}
	p := pki{caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})}
	p.serverCert, p.serverKey = leaf(2, x509.ExtKeyUsageServerAuth, []net.IP{net.ParseIP("127.0.0.1")})
	p.clientCert, p.clientKey = leaf(3, x509.ExtKeyUsageClientAuth, nil)
	return p
}

func TestMutualTLS(t *testing.T) {
	p := newPKI(t)
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(p.caPEM)
	clientCert, err := tls.X509KeyPair(p.clientCert, p.clientKey)
	if err != nil {
		t.Fatal(err)
	}
	ready := &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{clientCert}, MinVersion: tls.VersionTLS12}
	coordinator := testenv.StartTLS(t, testenv.SQLite, ready, "--tls-cert", write("server.pem", p.serverCert),
		"--tls-key", write("server.key", p.serverKey), "--tls-client-ca", write("ca.pem", p.caPEM))
	ctx := context.Background()
	work := func(context.Context, *idempotency.Lease) (int, error) { return 1, nil }

	c := testenv.NewClient(t, coordinator.Addr, idempotency.WithRootCAsPEM(p.caPEM), idempotency.WithClientCertificatePEM(p.clientCert, p.clientKey))
	if out, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, work); err != nil || out.Value != 1 {
		t.Fatalf("mutual TLS: %+v, %v", out, err)
	}
	// Without a client certificate the handshake is refused.
	noCert := testenv.NewClient(t, coordinator.Addr, idempotency.WithRootCAsPEM(p.caPEM), idempotency.WithRetryBudget(0))
	if _, err := noCert.Lookup(ctx, "payments", "k"); err == nil {
		t.Fatal("a client without a certificate was served")
	}
	// Nor is a server outside the trusted roots accepted.
	untrusting := testenv.NewClient(t, coordinator.Addr, idempotency.WithRetryBudget(0), idempotency.WithClientCertificatePEM(p.clientCert, p.clientKey))
	if _, err := untrusting.Lookup(ctx, "payments", "k"); !errors.Is(err, idempotency.ErrUnavailable) {
		t.Fatalf("an untrusted server: %v", err)
	}
}
