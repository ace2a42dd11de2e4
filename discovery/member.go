package discovery

// Member is one encoder a discovery source knows of.
type Member struct {
	Name   string // host:port: the encoder's identity (metric label, rendezvous)
	URL    string // scheme://host:port
	Source string // "dns" or "registered"
}
