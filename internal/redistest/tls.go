package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// certLifetime is how long the certificates the helper makes are valid; they
// start an hour in the past so that a clock a little behind still takes them.
const certLifetime = 24 * time.Hour

// CA is a certificate authority made for one test: an ECDSA P-256 key and a
// self-signed certificate, the certificate written as PEM to CertFile.
type CA struct {
	// CertFile is the CA certificate (PEM), for a client's ca_file.
	CertFile string

	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA makes a fresh CA in a temp dir of t. No server of this package
// trusts it or has a certificate from it: it is the "wrong CA" for tests that
// a client with it refuses the server, and IssueClient gives the client
// certificate a server with WithMutualTLS refuses.
func NewCA(t testing.TB) *CA {
	t.Helper()
	ca, err := newCA(t.TempDir(), "redistest other CA")
	if err != nil {
		t.Fatalf("redistest: NewCA: %v", err)
	}
	return ca
}

// Pool is a certificate pool holding only the CA, for tls.Config.RootCAs.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// IssueClient writes a new client certificate signed by the CA and its key
// (PEM, the key PKCS#8) and returns their paths.
func (ca *CA) IssueClient(t testing.TB) (certFile, keyFile string) {
	t.Helper()
	certFile, keyFile, _, err := ca.issue("client", false)
	if err != nil {
		t.Fatalf("redistest: IssueClient: %v", err)
	}
	return certFile, keyFile
}

func newCA(dir, name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certLifetime),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{CertFile: filepath.Join(dir, "ca.crt"), dir: dir, cert: cert, key: key}
	if err := writePEM(ca.CertFile, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return ca, nil
}

// issue writes name.crt and name.key into the CA's dir. A server
// certificate names 127.0.0.1, ::1 and localhost and serves for client
// authentication too: Redis presents it when it connects to a master, a
// cluster peer or another sentinel.
func (ca *CA) issue(name string, server bool) (certFile, keyFile string, pair tls.Certificate, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", pair, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "redistest " + name},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(certLifetime),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		tmpl.DNSNames = []string{"localhost"}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return "", "", pair, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return "", "", pair, err
	}
	certFile = filepath.Join(ca.dir, name+".crt")
	keyFile = filepath.Join(ca.dir, name+".key")
	if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
		return "", "", pair, err
	}
	if err := writePEM(keyFile, "PRIVATE KEY", keyDER); err != nil {
		return "", "", pair, err
	}
	pair = tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	return certFile, keyFile, pair, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(fmt.Sprintf("redistest: crypto/rand: %v", err)) // crypto/rand does not fail on Linux
	}
	return n
}

func writePEM(path, kind string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600)
}

// TLSFiles are the PEM files of a server started WithTLS or WithMutualTLS.
type TLSFiles struct {
	// CAFile is the CA that signed both certificates below.
	CAFile string
	// CertFile and KeyFile are the server's certificate and key, for
	// 127.0.0.1, ::1 and localhost.
	CertFile, KeyFile string
	// ClientCertFile and ClientKeyFile are a client certificate and key from
	// the same CA: what a client presents to a server WithMutualTLS.
	ClientCertFile, ClientKeyFile string
}

// tlsMaterial is the CA and certificates of one shape (one server, or all
// nodes of a sentinel or cluster set: they share them).
type tlsMaterial struct {
	files  TLSFiles
	ca     *CA
	client tls.Certificate
	mutual bool // tls-auth-clients yes
}

func newTLSMaterial(dir string, mutual bool) (*tlsMaterial, error) {
	ca, err := newCA(dir, "redistest CA")
	if err != nil {
		return nil, err
	}
	m := &tlsMaterial{ca: ca, mutual: mutual}
	m.files.CAFile = ca.CertFile
	if m.files.CertFile, m.files.KeyFile, _, err = ca.issue("server", true); err != nil {
		return nil, err
	}
	if m.files.ClientCertFile, m.files.ClientKeyFile, m.client, err = ca.issue("client", false); err != nil {
		return nil, err
	}
	return m, nil
}

// clientConfig trusts only the shape's CA and presents its client
// certificate. ServerName is left empty: Go's TLS dial takes the host of the
// address (127.0.0.1), which the server certificate names.
func (m *tlsMaterial) clientConfig() *tls.Config {
	if m == nil {
		return nil
	}
	return &tls.Config{
		RootCAs:      m.ca.Pool(),
		Certificates: []tls.Certificate{m.client},
		MinVersion:   tls.VersionTLS12,
	}
}

// args are the redis-server (or redis-sentinel) flags that serve TLS only,
// on port.
func (m *tlsMaterial) args(port int) []string {
	auth := "optional"
	if m.mutual {
		auth = "yes"
	}
	return []string{
		"--port", "0",
		"--tls-port", fmt.Sprint(port),
		"--tls-cert-file", m.files.CertFile,
		"--tls-key-file", m.files.KeyFile,
		"--tls-ca-cert-file", m.files.CAFile,
		"--tls-auth-clients", auth,
		// Replication (and a sentinel's links) over TLS too; harmless on a
		// server that has no replica.
		"--tls-replication", "yes",
	}
}
