package main

import (
	"fmt"
	"strings"
)

// diff is a short line diff from want to got: the changed lines, - for
// want's and + for got's, each run with up to two lines of context, at
// most maxDiffLines lines in all. It is "" when the texts are equal.
func diff(want, got string) string {
	if want == got {
		return ""
	}
	a, b := strings.Split(want, "\n"), strings.Split(got, "\n")
	// lcs[i][j] is the longest common subsequence of a[i:] and b[j:].
	lcs := make([][]int, len(a)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(b)+1)
	}
	for i := len(a) - 1; i >= 0; i-- {
		for j := len(b) - 1; j >= 0; j-- {
			if a[i] == b[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	type line struct {
		op   byte // ' ', '-', '+'
		text string
	}
	var lines []line
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case i < len(a) && j < len(b) && a[i] == b[j]:
			lines = append(lines, line{' ', a[i]})
			i, j = i+1, j+1
		case i < len(a) && (j == len(b) || lcs[i+1][j] >= lcs[i][j+1]):
			lines = append(lines, line{'-', a[i]})
			i++
		default:
			lines = append(lines, line{'+', b[j]})
			j++
		}
	}
	const context = 2
	keep := make([]bool, len(lines))
	for k, l := range lines {
		if l.op != ' ' {
			for c := max(0, k-context); c <= min(len(lines)-1, k+context); c++ {
				keep[c] = true
			}
		}
	}
	var out strings.Builder
	n, gap := 0, false
	for k, l := range lines {
		if !keep[k] {
			gap = true
			continue
		}
		if gap && n > 0 {
			out.WriteString("  ...\n")
		}
		gap = false
		if n == maxDiffLines {
			fmt.Fprintf(&out, "  ... (more)\n")
			break
		}
		fmt.Fprintf(&out, "%c %s\n", l.op, l.text)
		n++
	}
	return out.String()
}

const maxDiffLines = 40
