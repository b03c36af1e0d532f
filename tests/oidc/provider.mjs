// A real OpenID Connect provider for the tests of operator identity: oidc-provider, configured from a JSON file.
//
//   node provider.mjs CONFIG.json
//
// The file (written by tests/oidc_fixtures.py) holds the issuer URL and port, the signing keys (private JWKs, made
// afresh for every test session), the clients, the users with their passwords and groups, the audience of the
// Shepherd API (its resource indicator) among the resources the provider knows, and the lifetimes of what it
// issues. Access tokens for a resource are JWTs that carry the user's (or the client's) groups.
//
// The user step of the device flow goes through this provider's own pages: the device page takes the user code,
// the login page below a user's name and password, the consent page an approval or a denial.

import { readFileSync } from 'node:fs';

import Provider, { errors } from 'oidc-provider';

const config = JSON.parse(readFileSync(process.argv[2], 'utf8'));

const users = new Map(Object.entries(config.users));
const clientGroups = new Map(config.clients.map((client) => [client.client_id, client.groups ?? []]));
const lifetimes = new Map(config.clients.map((client) => [client.client_id, client.lifetimes ?? {}]));

// A client's own lifetime of an artifact when the test gave it one, else the provider-wide one.
function lifetime(kind, fallback) {
  return (_ctx, _artifact, client) => lifetimes.get(client?.clientId)?.[kind] ?? fallback;
}

const provider = new Provider(config.issuer, {
  jwks: config.jwks,
  cookies: { keys: config.cookieKeys },
  // oidc-provider takes only its own client metadata: the groups and lifetimes above are this script's.
  clients: config.clients.map(({ groups, lifetimes: _, ...metadata }) => metadata),
  claims: { openid: ['sub'], groups: ['groups'] },
  scopes: ['openid', 'offline_access', 'groups'],
  async findAccount(_ctx, sub) {
    const user = users.get(sub);
    if (!user) return undefined;
    return { accountId: sub, async claims() { return { sub, groups: user.groups }; } };
  },
  // The groups in every access token, as an authorization policy maps them to roles: a user's, or those given to
  // a client that acts for itself (client credentials).
  async extraTokenClaims(_ctx, token) {
    const groups = token.accountId ? users.get(token.accountId)?.groups : clientGroups.get(token.clientId);
    return groups ? { groups } : undefined;
  },
  features: {
    devInteractions: { enabled: false },
    clientCredentials: { enabled: true },
    deviceFlow: { enabled: true },
    revocation: { enabled: true },
    resourceIndicators: {
      enabled: true,
      // A CI tool that names no resource with its client credentials gets the Shepherd API; a login that names
      // none gets no token for it (as with most providers, whose access tokens then serve their userinfo alone).
      defaultResource: async (_ctx, client) => (client.grantTypes.includes('client_credentials') ? config.audience : undefined),
      // A refresh without a resource parameter is for the resource that was granted.
      useGrantedResource: async () => true,
      // The Shepherd API, and another service of the same organisation whose tokens the API must refuse.
      async getResourceServerInfo(_ctx, resource) {
        if (!config.resources.includes(resource)) throw new errors.InvalidTarget();
        return {
          // oidc-provider wants a scope of every resource; Shepherd asks for none, it goes by the groups.
          scope: 'fleet',
          audience: resource,
          accessTokenFormat: 'jwt',
          jwt: { sign: { alg: config.accessTokenAlg } },
        };
      },
    },
  },
  ttl: {
    AccessToken: lifetime('AccessToken', 600),
    ClientCredentials: lifetime('ClientCredentials', 600),
    DeviceCode: lifetime('DeviceCode', 600),
    RefreshToken: lifetime('RefreshToken', 86400),
    IdToken: 600,
    Grant: 86400,
    Interaction: 600,
    Session: 86400,
  },
  interactions: { url: (_ctx, interaction) => `/interaction/${interaction.uid}` },
  async renderError(ctx, out) {
    ctx.type = 'html';
    ctx.body = `<!DOCTYPE html><title>error</title><p id="error">${escape(out.error)}: ${escape(out.error_description ?? '')}</p>`;
  },
});

function escape(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function page(title, body) {
  return `<!DOCTYPE html><html><head><meta charset="utf-8"><title>${title}</title></head><body>${body}</body></html>`;
}

async function formBody(ctx) {
  const chunks = [];
  for await (const chunk of ctx.req) chunks.push(chunk);
  return new URLSearchParams(Buffer.concat(chunks).toString('utf8'));
}

function loginPage(uid, problem) {
  return page('Sign-in', `${problem ? `<p id="problem">${escape(problem)}</p>` : ''}
<form method="post" action="/interaction/${uid}/login">
<input type="text" name="login" autofocus><input type="password" name="password"><button type="submit">Sign in</button>
</form>`);
}

function consentPage(uid, clientId, details) {
  return page('Authorize', `<p>Allow <strong>${escape(clientId)}</strong> access: ${escape(JSON.stringify(details))}</p>
<form method="post" action="/interaction/${uid}/confirm"><button type="submit">Allow</button></form>
<form method="post" action="/interaction/${uid}/abort"><button type="submit">Deny</button></form>`);
}

// The login and consent pages: a user signs in with a name and password from the configuration, then allows or
// denies what the client asked for.
provider.use(async (ctx, next) => {
  const match = ctx.path.match(/^\/interaction\/([\w-]+)(?:\/(login|confirm|abort))?$/);
  if (!match) return next();
  const [, uid, action] = match;
  ctx.set('cache-control', 'no-store');
  const { prompt, params, session, grantId } = await provider.interactionDetails(ctx.req, ctx.res);
  if (ctx.method === 'GET' && !action) {
    ctx.type = 'html';
    ctx.body = prompt.name === 'login' ? loginPage(uid) : consentPage(uid, params.client_id, prompt.details);
    return undefined;
  }
  if (ctx.method !== 'POST' || !action) {
    ctx.status = 405;
    return undefined;
  }
  let result;
  if (action === 'login') {
    const form = await formBody(ctx);
    const user = users.get(form.get('login'));
    if (prompt.name !== 'login' || !user || user.password !== form.get('password')) {
      ctx.status = 401;
      ctx.type = 'html';
      ctx.body = loginPage(uid, 'unknown user or wrong password');
      return undefined;
    }
    result = { login: { accountId: form.get('login') } };
  } else if (action === 'confirm') {
    const grant = grantId
      ? await provider.Grant.find(grantId)
      : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
    const { missingOIDCScope, missingOIDCClaims, missingResourceScopes } = prompt.details;
    if (missingOIDCScope) grant.addOIDCScope(missingOIDCScope.join(' '));
    if (missingOIDCClaims) grant.addOIDCClaims(missingOIDCClaims);
    for (const [resource, scope] of Object.entries(missingResourceScopes ?? {})) {
      grant.addResourceScope(resource, scope.join(' '));
    }
    result = { consent: { grantId: await grant.save() } };
  } else {
    result = { error: 'access_denied', error_description: 'the user denied the request' };
  }
  const returnTo = await provider.interactionResult(ctx.req, ctx.res, result, {
    mergeWithLastSubmission: action === 'confirm',
  });
  ctx.status = 303;
  ctx.redirect(returnTo);
  return undefined;
});

// Like most providers, this one asks device-flow clients to poll at an interval of its choosing.
provider.use(async (ctx, next) => {
  await next();
  if (ctx.path === '/device/auth' && ctx.status === 200 && ctx.body?.device_code) {
    ctx.body = { ...ctx.body, interval: config.deviceInterval };
  }
});

provider.on('server_error', (_ctx, error) => console.error('server_error', error));

const server = provider.listen(config.port, '127.0.0.1', () => {
  console.log(`listening on ${config.issuer}`);
});

for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => server.close(() => process.exit(0)));
}
