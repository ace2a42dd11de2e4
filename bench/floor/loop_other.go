//go:build !linux

package main

import "errors"

func serve(string, string, waitMode, func(string, func())) error {
	return errors.New("floor needs Linux (epoll)")
}
