package redistest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"testing"

	"github.com/redis/go-redis/v9"
)

// tlsPing PINGs addr with go-redis over TLS with conf, without retries.
func tlsPing(t *testing.T, addr, password string, conf *tls.Config) error {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, Password: password, TLSConfig: conf, MaxRetries: -1, DialerRetries: 1})
	defer c.Close()
	return c.Ping(context.Background()).Err()
}

// caFileConfig is what a gateway builds from a ca_file: a pool of that file.
func caFileConfig(t *testing.T, caFile string) *tls.Config {
	t.Helper()
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatalf("%s holds no certificate", caFile)
	}
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
}

// WithTLS: a client trusting the CA file gets PONG; one trusting another CA
// refuses the server's certificate; plain TCP gets nothing; a password
// still applies over TLS; Restart keeps TLS.
func TestWithTLS(t *testing.T) {
	const pw = "tls pass"
	s := Start(t, WithTLS(), WithPassword(pw))
	f := s.TLS()
	if f == nil {
		t.Fatal("TLS() = nil for a server WithTLS")
	}
	check := func(when string) {
		t.Helper()
		if err := tlsPing(t, s.Addr(), pw, caFileConfig(t, f.CAFile)); err != nil {
			t.Errorf("%s: the CA file: %v", when, err)
		}
		if err := tlsPing(t, s.Addr(), pw, s.ClientTLSConfig()); err != nil {
			t.Errorf("%s: ClientTLSConfig: %v", when, err)
		}
		err := tlsPing(t, s.Addr(), pw, caFileConfig(t, NewCA(t).CertFile))
		var unknown x509.UnknownAuthorityError
		if !errors.As(err, &unknown) {
			t.Errorf("%s: another CA: %v, want x509.UnknownAuthorityError", when, err)
		}
		if err := tlsPing(t, s.Addr(), "", s.ClientTLSConfig()); err == nil {
			t.Errorf("%s: TLS without the password answered PING", when)
		}
		if err := ping(s.Addr(), pw); err == nil {
			t.Errorf("%s: plain TCP on the TLS port answered PING", when)
		}
	}
	check("started")
	s.Restart()
	check("restarted")

	if Start(t).TLS() != nil {
		t.Error("TLS() of a plain server is not nil")
	}
}

// WithMutualTLS: the client certificate (from ClientTLSConfig or the files)
// passes; no certificate, or one from another CA, is refused.
func TestWithMutualTLS(t *testing.T) {
	s := Start(t, WithMutualTLS())
	f := s.TLS()
	if err := tlsPing(t, s.Addr(), "", s.ClientTLSConfig()); err != nil {
		t.Errorf("ClientTLSConfig: %v", err)
	}
	withCert := func(certFile, keyFile string) *tls.Config {
		t.Helper()
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			t.Fatal(err)
		}
		c := caFileConfig(t, f.CAFile)
		c.Certificates = []tls.Certificate{pair}
		return c
	}
	if err := tlsPing(t, s.Addr(), "", withCert(f.ClientCertFile, f.ClientKeyFile)); err != nil {
		t.Errorf("the client certificate files: %v", err)
	}
	if err := tlsPing(t, s.Addr(), "", caFileConfig(t, f.CAFile)); err == nil {
		t.Error("no client certificate: PING answered")
	}
	if err := tlsPing(t, s.Addr(), "", withCert(NewCA(t).IssueClient(t))); err == nil {
		t.Error("a client certificate from another CA: PING answered")
	}
	// WithTLS alone asks for no client certificate; and each Start has its
	// own CA.
	s2 := Start(t, WithTLS())
	if err := tlsPing(t, s2.Addr(), "", caFileConfig(t, s2.TLS().CAFile)); err != nil {
		t.Errorf("WithTLS, no client certificate: %v", err)
	}
	if err := tlsPing(t, s2.Addr(), "", caFileConfig(t, f.CAFile)); err == nil {
		t.Error("another Start's CA file passed")
	}
}
