package main

import "bytes"

// maxMessage bounds a message the loop holds: more closes the pair.
const maxMessage = 64 << 10

// frameLen returns the length of the first whole message in b: its header
// and a Content-Length body. 0 means not whole yet; -1 means a message the
// floor does not carry (chunked, a bad length, or longer than maxMessage).
func frameLen(b []byte) int {
	end := bytes.Index(b, []byte("\r\n\r\n"))
	if end < 0 {
		if len(b) >= maxMessage {
			return -1
		}
		return 0
	}
	head := b[:end+2]
	body := 0
	for line := range bytes.SplitSeq(head, []byte("\r\n")) {
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			n, ok := atoi(bytes.TrimSpace(value))
			if !ok {
				return -1
			}
			body = n
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			return -1
		}
	}
	n := end + 4 + body
	switch {
	case n > maxMessage:
		return -1
	case len(b) < n:
		return 0
	}
	return n
}

// atoi parses a decimal length of up to 9 digits.
func atoi(b []byte) (int, bool) {
	if len(b) == 0 || len(b) > 9 {
		return 0, false
	}
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}
