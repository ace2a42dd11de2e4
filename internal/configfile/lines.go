package configfile

import (
	"bytes"
	"strings"
	"unicode/utf16"
)

// YAMLLines counts a document's lines as yaml.v3 does: broken at \n, \r\n,
// a lone \r, NEL, LS and PS, in UTF-8 or in UTF-16 told by its byte order
// mark.
func YAMLLines(data []byte) int {
	text := string(data)
	if bytes.HasPrefix(data, []byte{0xff, 0xfe}) || bytes.HasPrefix(data, []byte{0xfe, 0xff}) {
		units := make([]uint16, len(data)/2)
		for i := range units {
			units[i] = uint16(data[2*i])<<8 | uint16(data[2*i+1])
			if data[0] == 0xff {
				units[i] = units[i]>>8 | units[i]<<8
			}
		}
		text = string(utf16.Decode(units))
	}
	lines := 1
	for _, r := range strings.ReplaceAll(text, "\r\n", "\n") {
		switch r {
		case '\n', '\r', '\u0085', '\u2028', '\u2029':
			lines++
		}
	}
	return lines
}
