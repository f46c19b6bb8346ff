// Preloaded (node --require) into the conformance suite for the bridge's
// bearer mode: every HTTP request the suite makes (undici, and Node's fetch,
// which share undici's global dispatcher) carries the policy client's token
// from TOOLREG_CONFORMANCE_BEARER. The suite itself has no option for it.
'use strict';
const { Agent, setGlobalDispatcher } = require('undici');

const token = process.env.TOOLREG_CONFORMANCE_BEARER;
if (token) {
  const withToken = (headers) => {
    if (Array.isArray(headers)) {
      const kept = [];
      for (let i = 0; i + 1 < headers.length; i += 2) {
        if (String(headers[i]).toLowerCase() !== 'authorization') kept.push(headers[i], headers[i + 1]);
      }
      return [...kept, 'authorization', `Bearer ${token}`];
    }
    const kept = {};
    const entries = headers && typeof headers[Symbol.iterator] === 'function' && !(headers instanceof Object && !headers.entries)
      ? [...headers]
      : Object.entries(headers || {});
    for (const [name, value] of entries) {
      if (name.toLowerCase() !== 'authorization') kept[name] = value;
    }
    kept.authorization = `Bearer ${token}`;
    return kept;
  };
  setGlobalDispatcher(
    new Agent().compose((dispatch) => (opts, handler) =>
      dispatch({ ...opts, headers: withToken(opts.headers) }, handler)),
  );
}

// A few scenarios write raw HTTP with node:http (headers fetch would refuse).
if (token) {
  const http = require('http');
  const request = http.request;
  http.request = function withBearer(...args) {
    const req = request.apply(this, args);
    if (!req.headersSent && !req.getHeader('authorization')) {
      req.setHeader('authorization', `Bearer ${token}`);
    }
    return req;
  };
}
